"""Which checkpoint a run resumes from, and whether the plan may resume it.

- `usable_checkpoint`: rank 0 checks the complete checkpoints newest first against their marker
  (llmctl.engine.checkpoint_files.verify) and tells every rank the first one that passes. A damaged one is moved
  aside (`step_X` -> `step_X.damaged`: kept for a look, out of the pruning and of the next resume) with a warning;
  a folder without the marker stops the run (exit 2: its pickled files are never read); none left after damaged
  ones stops it too (exit 2), rather than silently training from step 0.
- `plan_fingerprint`: what in a plan changes the training's math (model, data, optimizer and its schedule,
  fine-tuning, precision, seed, clipping, the global batch), saved in trainer.pt. A resume under a plan whose
  fingerprint differs is refused, naming what changed, unless $LLMCTL_RESUME_ANYWAY=1 (`llmctl launch
  --resume-anyway`); the run length (max_steps, token_budget) is not part of it: a longer run is the same run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from llmctl.engine.checkpoint import complete_checkpoints
from llmctl.engine.checkpoint_files import DamagedCheckpoint, ForeignCheckpoint, verify
from llmctl.errors import InputError, SpecError
from llmctl.spec.planfile import Plan
from llmctl.spec.planpaths import PATH_KEYS

log = logging.getLogger("llmctl.engine")

RESUME_ANYWAY_ENV = "LLMCTL_RESUME_ANYWAY"
DAMAGED_SUFFIX = ".damaged"


def resume_anyway() -> bool:
    return os.environ.get(RESUME_ANYWAY_ENV) == "1"


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint out of the step_* names (rank 0); returns its new name."""
    dest = folder.with_name(folder.name + DAMAGED_SUFFIX)
    n = 1
    while dest.exists():
        n += 1
        dest = folder.with_name(f"{folder.name}{DAMAGED_SUFFIX}{n}")
    os.replace(folder, dest)
    return dest


def _first_usable(root: Path, below: int | None) -> tuple[tuple[int, str] | None, list[str], tuple[str, str] | None]:
    """Rank 0: (the newest verified checkpoint older than `below`, the warnings for the damaged ones set aside, a
    refusal (message, hint) for a foreign folder)."""
    warnings: list[str] = []
    for step, folder in reversed(complete_checkpoints(root)):
        if below is not None and step >= below:
            continue
        try:
            verify(folder)
        except DamagedCheckpoint as e:
            warnings.append(damaged_warning(e, folder))
            continue
        except ForeignCheckpoint as e:
            return None, warnings, (e.message, e.hint or "")
        return (step, str(folder)), warnings, None
    return None, warnings, None


def damaged_warning(e: DamagedCheckpoint, folder: Path) -> str:
    moved = set_aside(folder)
    return f"{e.message}; moved aside to {moved.name}, resuming from the previous complete checkpoint if any"


def usable_checkpoint(root: Path, rank: int, below: int | None = None) -> tuple[tuple[int, Path] | None, list[str]]:
    """A collective: (the checkpoint to resume from, or None; the warnings to log). Raises InputError on every
    rank for a folder without llmctl's marker, or when damaged checkpoints leave none to resume from."""
    import torch.distributed as dist

    msg: list[Any] = [_first_usable(root, below) if rank == 0 else None]
    dist.broadcast_object_list(msg, src=0)
    found, warnings, refusal = msg[0]
    if refusal is not None:
        raise ForeignCheckpoint(refusal[0], hint=refusal[1] or None)
    if found is None and warnings:
        raise InputError(f"no checkpoint left to resume from in {root}: {warnings[-1].split('; moved aside')[0]}")
    return (None if found is None else (found[0], Path(found[1]))), warnings


def plan_fingerprint(plan: Plan) -> dict[str, Any]:
    """Flat {key: value} of what changes the training's math (module docstring); plain data (trainer.pt is read
    with weights_only)."""
    d = plan.model_dump(mode="json")
    t, s = d["training"], plan.setup
    picked: dict[str, Any] = {
        **{f"model.{k}": v for k, v in d["model"].items()},
        **{f"data.{k}": v for k, v in d["data"].items() if k != "val"},
        **{f"optimizer.{k}": v for k, v in d["optimizer"].items()},
        **{f"finetune.{k}": v for k, v in d["finetune"].items()},
        "training.precision": t["precision"],
        "training.seq_len": t["seq_len"],
        "training.seed": t["seed"],
        "training.grad_clip": t["grad_clip"],
        "global batch (sequences per step)": s.tokens_per_step // s.seq_len,
    }
    return {k: _plain(v) for k, v in picked.items()}


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in sorted(v.items())}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    return v


def _same(key: str, saved: Any, current: Any) -> bool:
    """Whether a fingerprint value is unchanged. A path saved relative (a checkpoint of an llmctl that resolved a
    plan's paths from the current folder) is the same as the absolute one a plan now resolves to when that ends with
    it (llmctl.spec.planpaths: `examples/corpus` and `/home/me/llmctl/examples/corpus`)."""
    if saved == current:
        return True
    if key not in _PATH_FIELDS:
        return False
    pairs = zip(saved, current, strict=True) if _same_length_lists(saved, current) else [(saved, current)]
    return all(_same_path(a, b) for a, b in pairs)


_PATH_FIELDS = {f"{section}.{key}" for section, key in PATH_KEYS}


def _same_length_lists(a: Any, b: Any) -> bool:
    return isinstance(a, list) and isinstance(b, list) and len(a) == len(b)


def _same_path(saved: Any, current: Any) -> bool:
    if saved == current:
        return True
    if not (isinstance(saved, str) and isinstance(current, str)) or os.path.isabs(saved) or not os.path.isabs(current):
        return False
    tail = Path(os.path.normpath(saved)).parts
    return ".." not in tail and Path(current).parts[-len(tail) :] == tail


def fingerprint_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """'key: saved -> current' for each key that differs (none for a checkpoint saved without a fingerprint)."""
    if not saved:
        return []
    keys = [k for k in current if k in saved and not _same(k, saved[k], current[k])]
    keys += [k for k in current if k not in saved] + [k for k in saved if k not in current]
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys]


def check_fingerprint(path: Path, saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """The changes (empty: the same training); raises SpecError when there are some and no --resume-anyway."""
    changes = fingerprint_changes(saved, current)
    if changes and not resume_anyway():
        more = f" (+{len(changes) - 3} more)" if len(changes) > 3 else ""
        raise SpecError(
            f"checkpoint {path} was trained under another plan: {'; '.join(changes[:3])}{more}",
            hint="resume with the plan it was saved with, use a new checkpoint.dir, or `llmctl launch "
            "--resume-anyway` to continue with the new plan",
        )
    return changes


def resume_note(fingerprint: dict[str, Any], folder: Path) -> str | None:
    """dry-start: why the checkpoint in `folder` would not be resumed as it is by a plan of this `fingerprint` (no
    marker, damaged, another plan), or None. Reads and moves nothing but trainer.pt (plain data) once the marker
    matched."""
    from llmctl.engine.checkpoint_files import load_plain

    try:
        verify(folder)
        saved = load_plain(folder / "trainer.pt").get("fingerprint")
    except InputError as e:
        return f"the resume would stop or fall back: {e.message}"
    changes = fingerprint_changes(saved, fingerprint)
    if changes:
        verdict = "resumed anyway (--resume-anyway)" if resume_anyway() else "refused without --resume-anyway"
        return f"{folder} was trained under another plan ({'; '.join(changes)}): {verdict}"
    return None
