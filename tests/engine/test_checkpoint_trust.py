"""Checkpoints are read only as llmctl wrote them (issue 46): plain-data loading, the marker, damage, a full disk.

In this process, on a gloo world of one (no torchrun): a tiny model saved by the engine's Checkpointer, then
altered the way an attacker or an unlucky disk would.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from llmctl.engine.checkpoint import Checkpointer, rng_state, set_rng_state, step_dir_name
from llmctl.engine.checkpoint_files import MARKER, DamagedCheckpoint, ForeignCheckpoint, load_plain, verify
from llmctl.engine.resume import usable_checkpoint
from llmctl.errors import InputError, RuntimeFailure, describe


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    if dist.is_initialized():  # another module's group: leave it
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _save(root: Path, steps: tuple[int, ...] = (2, 4)) -> Checkpointer:
    ckpt = Checkpointer(root, keep_last=5, rank=0, plan_yaml="name: t\n")
    model, opt, sched = _model()
    for s in steps:
        ckpt.save(s, model, opt, sched, {"step": s, "samples_consumed": 8 * s})
    return ckpt


class Payload:
    """Unpickling it would create `path` (a harmless stand-in for os.system)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_rng_state_is_plain_data_and_round_trips(tmp_path: Path) -> None:
    """The RNG file loads with weights_only=True and restores python, numpy and torch streams exactly."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(load_plain(tmp_path / "rng.pt"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_pickled_payload_in_trainer_pt_does_not_run(tmp_path: Path) -> None:
    """A trainer.pt holding an object whose unpickling runs code: refused in one line (exit 2), never run. Fails on
    the old main: torch.load(weights_only=False) ran it at resume (and in the LoRA export)."""
    ckpt = _save(tmp_path / "ckpt", steps=(2,))
    folder = tmp_path / "ckpt" / step_dir_name(2)
    ran = tmp_path / "payload-ran"
    buf = io.BytesIO()
    torch.save({"step": 2, "scheduler": {}, "x": Payload(ran)}, buf)
    (folder / "trainer.pt").write_bytes(buf.getvalue())
    from llmctl.engine.checkpoint_files import write_marker

    write_marker(folder)  # even with a marker that matches (a copied-in folder, marker and all)
    with pytest.raises(InputError) as err:
        ckpt.read(folder)
    assert not ran.exists()
    message, code = describe(err.value)
    assert code == 2 and "\n" not in message and "trainer.pt" in message and "could run code" in message
    with pytest.raises(InputError):  # the LoRA export's reader too
        load_plain(folder / "trainer.pt")
    assert not ran.exists()


def test_folder_without_marker_is_refused(tmp_path: Path) -> None:
    """A step folder llmctl did not write (no marker): its .metadata is never unpickled; one line, exit 2, naming
    the marker. Fails on the old main: there was no marker, the folder was loaded."""
    _save(tmp_path / "ckpt", steps=(2,))
    folder = tmp_path / "ckpt" / step_dir_name(2)
    (folder / MARKER).unlink()
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "ran")))
    with pytest.raises(ForeignCheckpoint) as err:
        usable_checkpoint(tmp_path / "ckpt", rank=0)
    message, code = describe(err.value)
    assert code == 2 and str(folder / MARKER) in message and "\n" not in message
    from llmctl.engine.export import _read_metadata

    with pytest.raises(ForeignCheckpoint):
        _read_metadata(folder)
    assert not (tmp_path / "ran").exists()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


DAMAGE = {
    "truncated shard": lambda f: _truncate(next(f.glob("*.distcp"))),
    "truncated metadata": lambda f: _truncate(f / ".metadata"),
    "missing shard": lambda f: next(f.glob("*.distcp")).unlink(),
    "truncated rng": lambda f: _truncate(f / "rng-rank0.pt"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_falls_back_to_previous(tmp_path: Path, damage: str) -> None:
    """Each damage of the newest checkpoint: one line naming the file; the previous complete checkpoint is the one
    to resume (the damaged one moved aside); with none before it, exit 2. Fails on the old main: the newest was
    loaded and DCP's CheckpointException (a BaseException) gave a traceback."""
    root = tmp_path / "ckpt"
    ckpt = _save(root)
    newest = root / step_dir_name(4)
    DAMAGE[damage](newest)
    with pytest.raises(DamagedCheckpoint) as err:
        verify(newest)
    assert "\n" not in str(err.value) and str(newest) in str(err.value)
    found, warnings = usable_checkpoint(root, rank=0)
    assert found == (2, root / step_dir_name(2)) and len(warnings) == 1 and str(newest) in warnings[0]
    assert not newest.exists() and (root / (newest.name + ".damaged")).is_dir()
    model, opt, sched = _model()
    state = ckpt.load(found[1], model, opt, sched, ckpt.read(found[1]))
    assert state["step"] == 2
    # nothing before it: exit 2, one line
    DAMAGE[damage](root / step_dir_name(2))
    with pytest.raises(InputError) as none_left:
        usable_checkpoint(root, rank=0)
    message, code = describe(none_left.value)
    assert code == 2 and "no checkpoint left" in message and "\n" not in message


def test_dcp_load_failure_is_one_line(tmp_path: Path) -> None:
    """A shard that passes the marker's size check but cannot be read (its bytes altered): DamagedCheckpoint, not
    DCP's CheckpointException traceback."""
    root = tmp_path / "ckpt"
    ckpt = _save(root, steps=(2,))
    folder = root / step_dir_name(2)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)
    model, opt, sched = _model()
    with pytest.raises(DamagedCheckpoint) as err:  # the optimizer's pickled entries in the shard fail to load
        ckpt.load(folder, model, opt, sched, ckpt.read(folder))
    message, code = describe(err.value)
    assert code == 2 and "\n" not in message and str(folder) in message
    assert "weights_only" not in message  # torch's advice to load it unsafely is not passed on


def test_no_space_during_save_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while saving: one line naming the folder and the bytes needed, exit 1; the temporary folder gone,
    the previous checkpoint intact and still usable. Fails on the old main: the checkpoint's torch.save error was
    reported without the bytes, and DCP's own failure was a traceback."""
    root = tmp_path / "ckpt"
    ckpt = _save(root, steps=(2,))
    real = torch.save

    def full(obj: object, f: object, *a: object, **k: object) -> None:
        if str(f).endswith("trainer.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    model, opt, sched = _model()
    with pytest.raises(RuntimeFailure) as err:
        ckpt.save(4, model, opt, sched, {"step": 4, "samples_consumed": 32})
    message, code = describe(err.value)
    assert code == 1 and "no space left" in message and ".tmp-step_00000004" in message and "bytes" in message
    assert "\n" not in message
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(2)]
    verify(root / step_dir_name(2))


def test_no_space_writing_a_plan_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan -o` (write_atomic): ENOSPC is one line with the path and the bytes, exit 1, the old file intact.
    Fails on the old main: "internal error ... a bug in llmctl"."""
    from llmctl import fileio

    target = tmp_path / "plan.yaml"
    target.write_text("old\n")

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", fsync)
    with pytest.raises(RuntimeFailure) as err:
        fileio.write_atomic(target, "x" * 1000)
    message, code = describe(err.value)
    assert code == 1 and str(target) in message and "1,000 bytes" in message
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]


def test_dry_start_says_a_resume_would_be_refused(tmp_path: Path) -> None:
    """The fingerprint (issue 46): what changes the math changes it, a longer run does not; dry-start's note names
    the change before any rank starts."""
    from llmctl.engine.resume import fingerprint_changes, plan_fingerprint, resume_note
    from llmctl.spec.planfile import load_plan
    from tests.engine.conftest import write_plan

    old = load_plan(write_plan(tmp_path / "a", {"training": {"max_steps": 10}}))
    longer = load_plan(write_plan(tmp_path / "b", {"training": {"max_steps": 99}}))
    other = load_plan(write_plan(tmp_path / "c", {"optimizer": {"lr": 1e-3}, "training": {"seed": 7}}))
    assert fingerprint_changes(plan_fingerprint(old), plan_fingerprint(longer)) == []
    assert fingerprint_changes(plan_fingerprint(old), plan_fingerprint(other)) == [
        "optimizer.lr: 0.003 -> 0.001",
        "training.seed: 0 -> 7",
    ]
    ckpt = Checkpointer(tmp_path / "ckpt", keep_last=2, rank=0)
    model, opt, sched = _model()
    ckpt.save(2, model, opt, sched, {"step": 2, "fingerprint": plan_fingerprint(old)})
    folder = tmp_path / "ckpt" / step_dir_name(2)
    assert resume_note(plan_fingerprint(longer), folder) is None
    note = resume_note(plan_fingerprint(other), folder)
    assert note is not None and "optimizer.lr: 0.003 -> 0.001" in note and "refused" in note
    # dry-start's notes: where it would resume, what wins, and the refusal
    from llmctl.engine.dryrun import _resume_notes

    said = _resume_notes(tmp_path / "ckpt", False, plan_fingerprint(other))
    assert said == [f"would resume from {folder} (step 2); its weights win over model.weights", note]
    assert _resume_notes(tmp_path / "ckpt", True, plan_fingerprint(longer)) == [
        f"would resume from {folder} (step 2); its adapters on the base"
    ]
    assert _resume_notes(tmp_path / "none", False, plan_fingerprint(old)) == []
    (folder / MARKER).unlink()
    assert "llmctl-checkpoint.json: missing" in (resume_note(plan_fingerprint(old), folder) or "")
