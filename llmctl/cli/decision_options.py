"""The training decisions' flags, made from their declarations (llmctl.spec.setup, llmctl.spec.decisions): one set of
options for estimate-memory, plan, `tune MODEL` and `launch --dry-start`, not a hand-written list per command.

A command takes them with `@with_decisions(command, mode, after=...)`: the flags are added to its signature (after the
parameter `after`) and the command receives them as one dict, `decisions` (decision name -> value). The modes:
- "value" (estimate-memory): each flag with its default, the value the what-if is sized at;
- "pin" (plan): the decisions the planner searches are None unless pinned (their help says what is searched); the
  others keep their value (precision auto, the sequence: the model's default when None);
- "override" (launch --dry-start): None unless given, then the plan's value replaced.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Literal, Optional

import typer

from llmctl.cli.options import length_count
from llmctl.spec import decisions as dec
from llmctl.spec.decisions import Decision
from llmctl.spec.setup import TrainSetup

Mode = Literal["value", "pin", "override"]
PARSERS: dict[str, Callable[[Any], Any]] = {"--seq-len": length_count, "--loss-chunk": length_count}
"""Flags whose text is a length in tokens (`128k`)."""


def _type(d: Decision) -> type:
    if d.cli_type is not None:
        return d.cli_type
    return type(d.default) if d.default is not None else int


def _option(d: Decision, mode: Mode) -> tuple[Any, Any]:
    """(annotation, default) of a decision's flag in a mode."""
    kind = _type(d)
    loose = mode == "override" or (mode == "pin" and d.planning_default is None)
    if mode == "override":
        help_ = f"With --dry-start: size rank 0 at this value, not the plan's {d.key}. {d.help}"
    elif mode == "pin":
        help_ = d.pin_help or d.help
    else:
        help_ = d.help
    decls = [f"{d.flag}/--no-{d.flag.lstrip('-')}"] if kind is bool and loose else [d.flag]
    extra: dict[str, Any] = {"help": help_}
    if d.flag in PARSERS and kind is int:
        extra["parser"] = PARSERS[d.flag]
    if d.metavar:
        extra["metavar"] = d.metavar
    if kind is bool and loose:
        extra["show_default"] = False
    if mode == "override" and kind is int:
        extra.update(min=1)
    option = typer.Option(*decls, **extra)
    if loose:
        return Annotated[Optional[kind], option], None  # noqa: UP045 - typer reads Optional
    default = d.planning_default if mode == "pin" else d.estimate_default
    return Annotated[kind, option], (str(default) if kind is str else default)


def parameters(command: str, mode: Mode) -> list[inspect.Parameter]:
    """The decisions' flags on `command` (llmctl.spec.decisions.COMMANDS) as keyword parameters."""
    out = []
    for d in dec.on_command(TrainSetup, command):
        annotation, default = _option(d, mode)
        out.append(inspect.Parameter(d.param, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return out


def names(command: str) -> dict[str, str]:
    """Parameter name -> decision name of a command's decision flags (`micro_batch` -> micro_batch_size)."""
    return {d.param: d.name for d in dec.on_command(TrainSetup, command)}


def with_decisions(command: str, mode: Mode, after: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the decisions' flags of `command` to a command function after its parameter `after`; the function receives
    them as `decisions` (decision name -> value; in pin and override modes None where not given)."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(func, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "decisions"]
        i = [p.name for p in own].index(after) + 1
        added = [p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in parameters(command, mode)]
        by_param = names(command)

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            chosen = {by_param[k]: kwargs.pop(k) for k in list(kwargs) if k in by_param}
            return func(*args, decisions=chosen, **kwargs)

        new = sig.replace(parameters=[*own[:i], *added, *own[i:]])
        run.__signature__ = new  # type: ignore[attr-defined]
        # Evaluated, so that typer reads them here and not in this module's globals.
        run.__annotations__ = {p.name: p.annotation for p in new.parameters.values()} | {"return": None}
        run.__wrapped_decisions__ = (command, mode)  # type: ignore[attr-defined]
        del run.__wrapped__  # typer must read the signature above, not the function's own
        return run

    return wrap


def as_flags(command: str, decisions: dict[str, Any]) -> list[str]:
    """The flags that give these decisions on `command` in pin mode, those not at the command's default (what a row
    of `plan --compare` repeats)."""
    out = []
    for d in dec.on_command(TrainSetup, command):
        v = decisions.get(d.name)
        if v is not None and v != d.planning_default:
            out += d.spell(v).split(" ", 1)
    return out
