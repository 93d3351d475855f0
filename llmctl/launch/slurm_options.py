"""The SLURM options a user can give, declared once. Torch-free.

`SlurmOptions` is the single declaration: each field carries its command-line flags and help, and
`__post_init__` validates every value in one place. From it are derived the `llmctl launch` options
(`cli_parameters`), the sbatch template's `#SBATCH` lines (`directives`) and submitit's executor parameters
(`submitit_parameters`). Options are passed by name (`from_kwargs`): an unknown name is an error that lists the
valid ones, as submitit does for its executor parameters.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, get_origin, get_type_hints

from llmctl.errors import InputError, suggest
from llmctl.launch import shell

DEFAULT_SIGNAL_LEAD_S = 300
"""Seconds before the time limit at which SIGUSR1 arrives: enough for a large sharded checkpoint."""
# sbatch options llmctl writes itself: the checkpoint-and-requeue machinery depends on them.
_RESERVED_SBATCH = ("--signal", "--requeue", "--no-requeue", "--output", "--open-mode")
# submitit always writes --time; without --time we ask for a day (the partition may cap it).
_SUBMITIT_DEFAULT_TIME_S = 24 * 3600


def _option(*flags: str, help: str, directive: bool = False) -> dict[str, Any]:
    """Field metadata: the command-line flags, the help text, and whether the value is an `#SBATCH --<name>=`
    line of its own (validated with `shell.check_directive`)."""
    return {"flags": flags, "help": help, "directive": directive}


@dataclass(frozen=True)
class SlurmOptions:
    """What a user may ask SLURM for. Build with `from_kwargs` (names checked); construction validates."""

    time: str | None = field(
        default=None, metadata=_option("--time", "-t", help="Time limit, e.g. 4:00:00 or 2-00:00:00.", directive=True)
    )
    partition: str | None = field(
        default=None, metadata=_option("--partition", "-p", help="SLURM partition.", directive=True)
    )
    account: str | None = field(
        default=None, metadata=_option("--account", "-A", help="SLURM account.", directive=True)
    )
    qos: str | None = field(default=None, metadata=_option("--qos", help="SLURM QOS.", directive=True))
    constraint: str | None = field(
        default=None, metadata=_option("--constraint", "-C", help="SLURM node features, e.g. a100.", directive=True)
    )
    exclude: str | None = field(
        default=None, metadata=_option("--exclude", "-x", help="Nodes to avoid, e.g. gpu[03,07].", directive=True)
    )
    extra_sbatch_args: tuple[str, ...] = field(
        default=(), metadata=_option("--sbatch-arg", help="Extra sbatch option, repeatable: --sbatch-arg=--mem=0")
    )
    signal_lead_s: int = field(
        default=DEFAULT_SIGNAL_LEAD_S,
        metadata=_option("--signal-lead", help="Seconds before the time limit to signal a checkpoint (SIGUSR1)."),
    )

    def __post_init__(self) -> None:
        # Lists from the command line become tuples: the options are hashable and cannot change after checks.
        object.__setattr__(self, "extra_sbatch_args", tuple(self.extra_sbatch_args or ()))
        if self.signal_lead_s < 10:
            raise InputError(f"--signal-lead {self.signal_lead_s}: must be at least 10 seconds")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata["directive"] and value is not None:
                shell.check_directive(f.name, value)
        if self.time is not None and parse_time_s(self.time) <= self.signal_lead_s:
            raise InputError(
                f"--time {self.time}: the job would get its checkpoint signal ({self.signal_lead_s} s before the end) "
                "before it starts",
                hint="give a longer --time or a smaller --signal-lead",
            )
        for arg in self.extra_sbatch_args:
            shell.check_sbatch_arg(arg)
            if arg.split("=")[0] in _RESERVED_SBATCH:
                raise InputError(f"--sbatch-arg {arg}: llmctl sets this itself (it drives checkpoint and requeue)")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, **values: Any) -> SlurmOptions:
        """Options by name. None (an option not given on the command line) means the default."""
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            hint = suggest(unknown[0], cls.names())
            raise InputError(
                f"unknown SLURM option {unknown[0]!r}: valid options are {', '.join(cls.names())}", hint=hint
            )
        return cls(**{k: v for k, v in values.items() if v is not None})

    @classmethod
    def given_flags(cls, values: dict[str, Any]) -> list[str]:
        """The flags of options given a value that asks SLURM for something (for "only apply with --slurm").
        Options with a working default (the signal lead) are left out: they ask for nothing by themselves."""
        return [
            f.metadata["flags"][0]
            for f in fields(cls)
            if f.default in (None, ()) and f.name in values and values[f.name] not in (None, (), [])
        ]

    def directives(self) -> list[tuple[str, str]]:
        """`#SBATCH --<name>=<value>` pairs for the options given, in declaration order (validated values)."""
        return [
            (f.name, getattr(self, f.name))
            for f in fields(self)
            if f.metadata["directive"] and getattr(self, f.name) is not None
        ]

    @property
    def time_s(self) -> int | None:
        return parse_time_s(self.time) if self.time is not None else None

    def submitit_parameters(self) -> dict[str, Any]:
        """These options as submitit.SlurmExecutor parameters (the job's own size and name are the caller's)."""
        additional: dict[str, Any] = {"requeue": True, "open-mode": "append"}
        for arg in self.extra_sbatch_args:
            key, _, value = arg.lstrip("-").partition("=")
            additional[key] = value if value else True
        params: dict[str, Any] = {
            # submitit's time is in minutes: round up so the signal lead still fits.
            "time": max(1, -(-(self.time_s or _SUBMITIT_DEFAULT_TIME_S) // 60)),
            "signal_delay_s": self.signal_lead_s,
            "additional_parameters": additional,
        }
        # The other directives have submitit parameters of the same name.
        params.update((name, value) for name, value in self.directives() if name != "time")
        return params


def cli_parameters() -> list[inspect.Parameter]:
    """One typer option per field (keyword parameters named like the fields), for a command's signature."""
    import typer

    hints = get_type_hints(SlurmOptions)
    out = []
    for f in fields(SlurmOptions):
        kind, default = hints[f.name], f.default
        if get_origin(kind) is tuple:  # a repeatable option: typer collects a list (None when not given)
            kind, default = list[str] | None, None
        option = typer.Option(*f.metadata["flags"], help=f.metadata["help"])
        out.append(
            inspect.Parameter(
                f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option]
            )
        )
    return out


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time_s(value: str) -> int:
    """SLURM --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S -> seconds."""
    m = _TIME.match(value)
    if not m:
        raise InputError(
            f"--time {value!r}: not a SLURM time", hint="use minutes, HH:MM:SS or D-HH:MM:SS, e.g. 4:00:00"
        )
    days, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, s = (nums + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if len(nums) == 1:
        return nums[0] * 60
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]
    return (nums[0] * 60 + nums[1]) * 60 + nums[2]
