"""The `llmctl` app: one command module per command, imported when that command runs; maps LlmctlError to one line +
an exit code.

The root group's commands are a lazy mapping (`_Commands`): `llmctl plan` imports llmctl.cli.plan and nothing of the
other commands (their imports are most of the start-up time: `benchmarks/plan_speed.py`); listing the commands
(`--help`, completion, a mistyped name's suggestions, the docs) imports them all, in the order they are listed.

The mapping lives in `_Group.invoke` (through `llmctl.errors.report`, the one error path), so it holds for the
console script, `python -m llmctl` and `typer.testing.CliRunner` alike. Debug mode (errors.debug) re-raises.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, MutableMapping
from typing import NoReturn

import click
import typer
import typer.main
from typer.core import TyperGroup
from typer.exceptions import TyperException

from llmctl.errors import PREFIX, one_line, report


def _usage_error(e: BaseException) -> NoReturn:
    """A usage error (unknown command or option, a malformed value): click's own message, with the close matches
    it suggests, as one line like every other bad input, and its exit code (2)."""
    hint = ""
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        hint = f" (see '{ctx.command_path} --help')"
    click.echo(one_line(f"{PREFIX}{e.format_message()}{hint}"), err=True)  # type: ignore[attr-defined]
    sys.exit(getattr(e, "exit_code", 2))


def _is_usage_error(e: BaseException) -> bool:
    # typer >= 0.20 vendors click (typer._click): its exceptions derive from TyperException, not click's.
    # No arguments at all (no_args_is_help) raises one with an empty message after printing the help: keep it.
    return (
        isinstance(e, (click.ClickException, TyperException))
        and hasattr(e, "format_message")
        and bool(e.format_message())
    )


class _Group(TyperGroup):
    def get_command(self, ctx: click.Context, cmd_name: str):  # type: ignore[override]
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            from llmctl.bounds import bound_numbers

            bound_numbers(command, typer.BadParameter)  # every numeric option: finite, in a documented range
        return command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        try:
            return super().parse_args(ctx, args)
        except Exception as e:
            if _is_usage_error(e):
                _usage_error(e)
            raise

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, typer.Exit, typer.Abort, SystemExit, BrokenPipeError):
            raise  # --help and ctx.exit() end through Exit (typer >= 0.20 has its own, not click's)
        except (Exception, KeyboardInterrupt) as e:
            if _is_usage_error(e):
                _usage_error(e)
            if isinstance(e, TyperException):
                raise
            sys.exit(report(e))  # LlmctlError: one line; anything else is a bug: one line too


# The command modules in the order `llmctl --help` lists them, each with the commands its `register` adds (a test
# checks the names against what each module registers).
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "estimate": ("estimate-memory", "estimate"),
    "bench_net": ("bench-net",),
    "plan": ("plan",),
    "launch": ("launch",),
    "jobs": ("status", "logs", "cancel", "requeue"),
    "tune": ("tune",),
    "export": ("export",),
    "data": ("data",),
}
_MODULE_OF = {name: mod for mod, names in COMMAND_MODULES.items() for name in names}
_REGISTERED: dict[str, typer.Typer] = {}


def _module_app(mod: str) -> typer.Typer:
    """A Typer holding one command module's commands, registered once per process (a module's `register` wraps its
    functions' signatures: twice would add their options twice)."""
    if mod not in _REGISTERED:
        from llmctl.measure import fake  # imports torch only when a model type needs measuring

        fake.install()
        sub = typer.Typer(cls=_Group, pretty_exceptions_enable=False, add_completion=False)
        # A command module that fails to import is a broken install: fail loudly, never drop the command.
        __import__(f"llmctl.cli.{mod}", fromlist=["register"]).register(sub)
        _REGISTERED[mod] = sub
    return _REGISTERED[mod]


class _Commands(MutableMapping):
    """The root group's commands by name, each module's built (fresh click commands, as typer builds them per
    invocation) the first time one of its names is asked for; iterating builds them all, in COMMAND_MODULES order."""

    def __init__(self) -> None:
        self._built: dict[str, click.Command] = {}
        self._modules: set[str] = set()

    def _load(self, mod: str) -> None:
        if mod not in self._modules:
            self._modules.add(mod)
            self._built.update(typer.main.get_group(_module_app(mod)).commands)

    def _load_all(self) -> None:
        for mod in COMMAND_MODULES:
            self._load(mod)
        order = [n for names in COMMAND_MODULES.values() for n in names]
        self._built = {
            **{n: self._built[n] for n in order if n in self._built},
            **{n: c for n, c in self._built.items() if n not in order},
        }

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._built and name in _MODULE_OF:
            self._load(_MODULE_OF[name])
        return self._built[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        self._load_all()
        del self._built[name]

    def __iter__(self) -> Iterator[str]:
        self._load_all()
        return iter(list(self._built))

    def __len__(self) -> int:
        self._load_all()
        return len(self._built)


class _Root(_Group):
    """The root group: its commands imported on demand (`_Commands`)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        lazy = _Commands()
        lazy.update(self.commands)  # none: the app registers only its callback
        self.commands = lazy


app = typer.Typer(
    cls=_Root,
    name="llmctl",
    help="From 'train model M on hardware H' to a running, well-tuned training job.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion (docs/getting-started.md)
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"llmctl {version('llmctl')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print llmctl's version and exit.", callback=_print_version, is_eager=True
    ),
) -> None:
    pass


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        # `llmctl ... | head`: the reader left. Silence the flush at exit and end like a finished command.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()
