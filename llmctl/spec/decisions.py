"""Each training decision declared once (torch-free).

A decision is a field of `llmctl.spec.setup.TrainSetup` (or of a setup part it holds: `MemoryLevers`, `Finetune`)
declared with `decision(...)`, which keeps beside the field's default everything the other layers need to know about
it: its plan-file key (and older keys still read), its type in the plan file, its command-line flag and help and on
which commands the flag appears, what the planner does with it when the user does not pin it, and whether a plan file
writes it when it has its default. torchtitan's config dataclasses (one field, one docstring, read from the file and
the command line alike) are the model.

Derived from the declarations, and nowhere written again:
- the plan file's decision fields (`llmctl.spec.planfile`: `file_fields`, and `Plan.setup` / `setup_sections`);
- the options of `estimate-memory`, `plan`, `tune` and `launch --dry-start` (`llmctl.cli.decision_options`);
- the planner's pins (`PlanRequest.pins`; a setup of the search is `with_values(base, **choice)`) and its search key
  (`search_key`);
- a setup's decisions as a dict (`values`), and the reference docs (docs/hooks.py).
The rules between decisions live in `llmctl.spec.rules`.

Adding a decision is adding one field with `decision(...)` (and, if it constrains others, one rule): see
docs/development/adding-a-dimension.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

COMMANDS = ("estimate", "plan", "dry-start")
"""Where a decision's flag can appear: estimate-memory (a value, the what-if), plan and `tune MODEL` (a pin: the
planner searches it when not given, or uses the request's value), launch --dry-start (rank 0 sized at another value
than the plan's)."""


class _Same:
    """No value of its own: the setup field's default."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()

Search = Literal["key", "best", "run"]
"""What the planner does with a decision it is not pinned to: "key", each value is a family of the search (the
search keeps each family's best); "best", the search finds the best value inside each family (the micro-batch); "run",
one search per value (CPU offload: without, then with where it could win)."""


@dataclass(frozen=True)
class Decision:
    """What the layers know about one decision. `name` is the setup's attribute (filled from the field)."""

    key: str
    """Plan-file key, `section.key` (`parallel.tp`); "" when the plan file does not hold it (estimate's what-ifs)."""
    help: str
    """What it is, one or two sentences: the plan-file reference and the flag's help start with it."""
    flag: str | None = None
    """The command-line flag (`--tp`); None: plan file only."""
    commands: tuple[str, ...] = ("estimate", "plan")
    """COMMANDS the flag appears on."""
    file_type: Any = None
    """The plan file's annotation (pydantic: bounds, literals, validators); None: not in the plan file."""
    bounds: Mapping[str, float] = field(default_factory=dict)
    """The plan file's bounds of a number (ge, gt, le, lt: pydantic's Field keywords)."""
    file_default: Any = SAME
    """The plan file's default when it differs from the setup's."""
    write_default: bool = True
    """False: a plan file omits the key at its default (plans written before it existed read and write as before)."""
    aliases: tuple[str, ...] = ()
    """Older or other plan-file keys of the same section still read (`training.checkpointing`)."""
    cli_type: Any = None
    """The flag's Python type (int, bool, str, float); None: the field's own type. A bool flag is `--x/--no-x` when
    the command takes it as a pin."""
    cli_parser: Callable[[Any], Any] | None = None
    """How the flag's text becomes a value (`128k` -> 131072)."""
    cli_default: Any = SAME
    """estimate-memory's default when it differs from the setup's (precision `auto`)."""
    plan_default: Any = SAME
    """`llmctl plan`'s default of a decision it does not search, when it differs from estimate-memory's (the
    sequence: None, the model's own)."""
    metavar: str | None = None
    search: Search | None = None
    """What the planner does when not pinned (`Search`); None: the request's value (precision, the sequence)."""
    pin_help: str = ""
    """The plan's flag help, when it says more than `help` (what is searched when it is not given)."""
    json: str | None = None
    """Its key in a candidate's JSON (`llmctl plan --json`, tune's report); None: not there."""
    to_file: Callable[[Any], Any] | None = None
    """The setup's value as the plan file writes it (a policy -> its name; () -> None), when they differ."""
    to_setup: Callable[[Any], Any] | None = None
    """The plan file's value as the setup takes it (a list -> a tuple), when they differ."""
    name: str = ""
    """The setup's attribute, or for a part's field the name it goes by everywhere (`lora_rank`)."""
    path: tuple[str, ...] = ()
    """Attributes from the setup to the field (("levers", "offload"))."""
    default: Any = None

    @property
    def section(self) -> str:
        return self.key.split(".", 1)[0] if self.key else ""

    @property
    def file_key(self) -> str:
        return self.key.split(".", 1)[1] if self.key else ""

    @property
    def in_file(self) -> bool:
        return bool(self.key) and self.file_type is not None

    @property
    def plan_file_default(self) -> Any:
        return self.default if self.file_default is SAME else self.file_default

    @property
    def estimate_default(self) -> Any:
        return self.default if self.cli_default is SAME else self.cli_default

    @property
    def planning_default(self) -> Any:
        """What `llmctl plan` takes when the flag is not given: None (searched) for a decision the planner searches,
        else its value."""
        if self.search is not None:
            return None
        return self.estimate_default if self.plan_default is SAME else self.plan_default

    def spell(self, value: Any) -> str:
        """The flag giving `value` (`--tp 2`; a bool `--compile` or `--no-compile`)."""
        if isinstance(value, bool):
            return self.flag if value else f"--no-{self.flag.lstrip('-')}"  # type: ignore[union-attr]
        return f"{self.flag} {value}"

    @property
    def param(self) -> str:
        """The Python parameter name of its flag (`--loss-chunk` -> loss_chunk)."""
        return (self.flag or self.name).lstrip("-").replace("-", "_")


META = "llmctl.decision"
PART = "llmctl.decision-part"


def decision(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field that is a training decision (the keywords: `Decision`'s)."""
    d = Decision(**meta)
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={META: d})
    return field(default=default, metadata={META: d})


def part(factory: type) -> Any:
    """A dataclass field holding a part of the setup whose own fields are decisions (`MemoryLevers`, `Finetune`)."""
    return field(default_factory=factory, metadata={PART: factory})


def _walk(cls: type, path: tuple[str, ...] = ()) -> Iterator[Decision]:
    for f in fields(cls):
        meta = f.metadata.get(META)
        if meta is not None:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            yield dataclasses.replace(meta, name=meta.name or f.name, path=(*path, f.name), default=default)
        elif PART in f.metadata and is_dataclass(f.metadata[PART]):
            yield from _walk(f.metadata[PART], (*path, f.name))


_CACHE: dict[type, tuple[Decision, ...]] = {}


def declared(cls: type) -> tuple[Decision, ...]:
    """The decisions of a setup class, in declaration order (parts' decisions where the part stands)."""
    if cls not in _CACHE:
        found = tuple(_walk(cls))
        names = [d.name for d in found]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise TypeError(f"decisions declared twice: {sorted(dup)}")
        _CACHE[cls] = found
    return _CACHE[cls]


_BY_NAME: dict[type, dict[str, Decision]] = {}


def _by_name(cls: type) -> dict[str, Decision]:
    """declared(cls) by name (with_values runs for every setup the planner builds)."""
    if cls not in _BY_NAME:
        _BY_NAME[cls] = {d.name: d for d in declared(cls)}
    return _BY_NAME[cls]


def get(setup: Any, d: Decision) -> Any:
    v = setup
    for attr in d.path:
        v = getattr(v, attr)
    return v


def values(setup: Any) -> dict[str, Any]:
    """Every decision of a setup by name (parts flattened: `offload`, `lora_rank`)."""
    return {d.name: get(setup, d) for d in declared(type(setup))}


def with_values(setup: Any, **changes: Any) -> Any:
    """`dataclasses.replace` by decision name, parts included (`with_values(s, tp=2, offload=True)`): the setup is
    built (and checked) once."""
    by_name = _by_name(type(setup))
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, v in changes.items():
        d = by_name.get(name)
        if d is None:
            if name in {f.name for f in fields(setup)}:
                top[name] = v  # a field that is not a decision (a derived or estimator setting)
                continue
            raise TypeError(f"{type(setup).__name__} has no decision {name!r}")
        if len(d.path) == 1:
            top[d.path[0]] = v
        else:
            parts.setdefault(d.path[0], {})[d.path[1]] = v
    for part, vals in parts.items():
        top[part] = dataclasses.replace(getattr(setup, part), **vals)
    return dataclasses.replace(setup, **top) if top else setup


def as_json(setup: Any) -> dict[str, Any]:
    """A setup's decisions as a candidate's JSON holds them (each `json` key; one written only when asked, at its
    default left out)."""
    out = {}
    for d in declared(type(setup)):
        if d.json is None:
            continue
        v = get(setup, d)
        if d.write_default or v != d.default:
            out[d.json] = v.name if hasattr(v, "compute_dtype") else (str(v) if isinstance(v, str) else v)
    return out


def in_section(cls: type, section: str) -> list[Decision]:
    return [d for d in declared(cls) if d.in_file and d.section == section]


def on_command(cls: type, command: str) -> list[Decision]:
    """The decisions with a flag on `command` (COMMANDS)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    return [d for d in declared(cls) if d.flag and command in d.commands]


def searched(cls: type, how: Search) -> tuple[str, ...]:
    return tuple(d.name for d in declared(cls) if d.search == how)


def search_key(setup: Any) -> tuple[Any, ...]:
    """What makes a setup its own family of the planner's search (the "key" decisions, and the nodes used)."""
    return (setup.nodes, *(get(setup, d) for d in declared(type(setup)) if d.search == "key"))


def pinned(pins: Mapping[str, Any]) -> dict[str, Any]:
    """The pins given (not None)."""
    return {k: v for k, v in pins.items() if v is not None}
