"""The `llmctl` app: registers one command per module and maps LlmctlError to one line + an exit code.

The mapping lives in `_Group.invoke` (through `llmctl.errors.report`, the one error path), so it holds for the
console script, `python -m llmctl` and `typer.testing.CliRunner` alike. Debug mode (errors.debug) re-raises.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import click
import typer
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


app = typer.Typer(
    cls=_Group,
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


def _register() -> None:
    # Each command module only defines its command(s); importing them must stay torch-free.
    from llmctl.cli import estimate
    from llmctl.measure import fake  # imports torch only when a model type needs measuring

    fake.install()

    estimate.register(app)
    for mod in ("bench_net", "plan", "launch", "jobs", "tune", "export", "data"):
        # A command module that fails to import is a broken install: fail loudly, never drop the command.
        __import__(f"llmctl.cli.{mod}", fromlist=["register"]).register(app)


_register()


def main() -> None:
    try:
        app()
    except BrokenPipeError:
        # `llmctl ... | head`: the reader left. Silence the flush at exit and end like a finished command.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    main()
