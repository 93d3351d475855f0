"""`llmctl plan`'s checks of flags that do nothing without another (kept apart: the command module only parses)."""

from __future__ import annotations

from pathlib import Path

from llmctl.errors import InputError


def check_flags(
    no_write: bool,
    output: str | None,
    force: bool,
    run_flags: list[str],
    tokenizer: str | None,
    data: list[str] | None,
    synthetic: bool,
    params: str | None,
    checkpoint_every: float,
) -> None:
    """Flags that do nothing without another: one line naming them (exit 2)."""
    if no_write:
        pointless = [f for f, given in (("-o", output), ("--force", force)) if given] + run_flags
        if pointless:
            raise InputError(f"{', '.join(pointless)} only apply to a plan file, and --no-write writes none")
    if params is not None and run_flags:
        raise InputError(f"{', '.join(run_flags)}: --params writes no plan file (pass a preset or a config.json)")
    if tokenizer is not None and not data:
        raise InputError("--tokenizer only applies with --data (text files are tokenized with it)")
    if data and synthetic:
        raise InputError("give either --data PATH or --synthetic, not both")
    if not checkpoint_every > 0:
        raise InputError(f"--checkpoint-every must be a positive number of minutes, got {checkpoint_every}")


def plan_target(output: str | None, force: bool) -> Path:
    """Where the plan file goes (-o, default plan.yaml), checked before anything is planned or printed, as --plot's
    file is: a missing folder is refused (never created: a typo in -o would otherwise leave a tree of folders), and
    an existing file without --force (the user's file stays as it is). One line each, exit 2."""
    path = Path(output or "plan.yaml")
    if not path.parent.is_dir():
        raise InputError(f"-o {path}: folder {path.parent} does not exist")
    if path.is_dir():
        raise InputError(f"-o {path}: is a folder (give the plan file's name, e.g. -o {path / 'plan.yaml'})")
    if path.exists() and not force:
        raise InputError(
            f"{path} already exists; nothing was planned",
            hint=f"pass --force to replace it, or -o another path (e.g. -o {path.with_name(path.stem + '-new' + path.suffix)})",
        )
    return path
