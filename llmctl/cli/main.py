"""The `llmctl` app: registers one command per module and maps LlmctlError to one line + an exit code.

The mapping lives in `_Group.invoke`, so it holds for the console script, `python -m llmctl` and
`typer.testing.CliRunner` alike. `LLMCTL_DEBUG=1` re-raises with the traceback.
"""

from __future__ import annotations

import os
import sys

import click
import typer
from typer.core import TyperGroup

from llmctl.errors import LlmctlError


def _fail(message: str, code: int) -> None:
    click.echo(f"llmctl: error: {message}", err=True)
    sys.exit(code)


class _Group(TyperGroup):
    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except LlmctlError as e:
            if os.environ.get("LLMCTL_DEBUG") == "1":
                raise
            _fail(str(e), e.exit_code)
        except (
            click.exceptions.Exit,
            click.exceptions.Abort,
            click.ClickException,
            SystemExit,
            typer.Exit,
            typer.Abort,
            BrokenPipeError,
        ):
            # typer >= 0.20 has its own Exit/Abort (not click's): --help and ctx.exit() raise them.
            raise
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as e:  # a bug: still one line, the traceback on request
            if os.environ.get("LLMCTL_DEBUG") == "1":
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (set LLMCTL_DEBUG=1 for the traceback)", 1)


app = typer.Typer(
    cls=_Group,
    name="llmctl",
    help="From 'train model M on hardware H' to a running, well-tuned training job.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _register() -> None:
    # Each command module only defines its command(s); importing them must stay torch-free.
    from llmctl.cli import estimate

    estimate.register(app)
    for mod in ("bench_net", "plan", "launch"):
        try:
            module = __import__(f"llmctl.cli.{mod}", fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != f"llmctl.cli.{mod}":
                raise
            continue
        module.register(app)


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
