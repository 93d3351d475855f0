"""Where a plan file's paths point: relative ones resolve against the plan file's folder, absolute ones stay.
Torch-free.

A plan launched from any folder (a SLURM job's working directory, another shell, a tune trial) must read the same
data and write the same checkpoints: so the anchor is the file, not the current directory. `load_plan` resolves
every path-like key once (`resolve`), and every reader of a loaded plan (launch, the engine on each rank, dry-run,
dry-start, tune, export, status) sees absolute paths; `llmctl plan` writes the paths it was given on the command line
(relative to where it was typed) relative to the plan file's folder (`relocate`).

The keys are declared once here (`PATH_KEYS`). A model.config that names a Hugging Face hub id rather than a file
(`Qwen/Qwen3-8B`: not a .json, nothing of that name beside the plan) is left as it is, as
llmctl.spec.models.from_config_ref reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmctl.errors import SpecError
from llmctl.spec.text import describe_char, refused_char

PATH_KEYS: tuple[tuple[str, str], ...] = (
    ("model", "config"),
    ("model", "weights"),
    ("data", "paths"),
    ("data", "tokenizer"),
    ("data", "val"),
    ("checkpoint", "dir"),
    ("logging", "dir"),
)
"""(section, key) of every plan-file value that is a path (or a list of paths)."""
RUN_KEYS = (("checkpoint", "dir"), ("logging", "dir"))
"""The run folder's keys: `llmctl plan` writes its default run folder (runs/<name>) as it is, beside the plan."""
NOT_PATHS = {("data", "val"): {"split"}}
"""Words a path key takes that are not paths (data.val: split)."""


def _hub_id(section: str, key: str, value: str, folder: Path) -> bool:
    """A model.config that names a hub id: not a .json file and nothing of that name in `folder` (as
    llmctl.spec.models.from_config_ref decides)."""
    if (section, key) != ("model", "config") or value.endswith(".json") or (folder / value).exists():
        return False
    from llmctl.spec.hub import looks_like_hub_id

    return looks_like_hub_id(value)


def _map(data: Any, fn: Callable[[str, str, str], str], keys: tuple[tuple[str, str], ...]) -> Any:
    """`data` (a plan as a mapping) with `fn(section, key, path)` applied to each path of `keys`; anything else as it
    is (a malformed value is left for the schema to name)."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for section, key in keys:
        part = out.get(section)
        if not isinstance(part, dict) or key not in part:
            continue

        def one(v: Any, section: str = section, key: str = key) -> Any:
            if not isinstance(v, str) or not v or v in NOT_PATHS.get((section, key), ()):
                return v
            return fn(section, key, v)

        v = part[key]
        out[section] = {**part, key: [one(x) for x in v] if isinstance(v, list) else one(v)}
    return out


def resolve(data: Any, folder: str | os.PathLike[str], source: str = "plan") -> Any:
    """The plan's relative paths as absolute ones, against `folder` (the plan file's), normalized (`a/../b`: `b`).
    A folder whose path is not one line of printable text (a line break in a folder's name) cannot anchor them: a
    plan's paths are one line (llmctl.spec.text), so that is one SpecError line naming the key."""
    base = Path(folder).absolute()

    def fn(section: str, key: str, v: str) -> str:
        if os.path.isabs(v) or _hub_id(section, key, v, base):
            return v
        if (c := refused_char(str(base))) is not None:
            raise SpecError(
                f"{source}: {section}.{key}: {v!r} resolves against the plan file's folder, whose path contains "
                f"{describe_char(c)} (a plan's paths are one line of printable text)",
                hint="give it as an absolute path, or move the plan to another folder",
            )
        return os.path.normpath(base / v)

    return _map(data, fn, PATH_KEYS)


def relocate(
    data: Any, folder: str | os.PathLike[str], keys: tuple[tuple[str, str], ...] = PATH_KEYS, cwd: Path | None = None
) -> Any:
    """Paths given relative to the current folder (`cwd`), rewritten for a plan file written in `folder`: as they are
    when `folder` is the current folder; relative to `folder` when both lie under the current folder (a project's
    tree moves as a whole); else absolute."""
    here = (cwd or Path.cwd()).absolute()
    base = Path(os.path.normpath(Path(folder).absolute()))
    if base == here:
        return data

    def fn(section: str, key: str, v: str) -> str:
        if os.path.isabs(v) or _hub_id(section, key, v, here):
            return v
        target = Path(os.path.normpath(here / v))
        if target.is_relative_to(here) and base.is_relative_to(here):
            return os.path.relpath(target, base)
        return str(target)

    return _map(data, fn, keys)
