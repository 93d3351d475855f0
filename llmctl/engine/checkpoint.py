"""Sharded, atomic, resumable checkpoints with torch.distributed.checkpoint (DCP), and preemption signals.

Layout of checkpoint.dir:
    step_00000020/           complete checkpoints (DCP shards + .metadata, trainer.pt, rng-rank<R>.pt, plan.yaml:
                             the plan that trained it, so `llmctl export` needs nothing else)
    .tmp-step_00000030/      a save in progress (or one a crash interrupted: ignored and deleted at start)
A save writes everything into the temporary folder, waits for every rank, then rank 0 renames it: a rename is
atomic, so a folder named step_* is always complete, and a crash in the middle of a save leaves the previous
checkpoints untouched. Old checkpoints are pruned (keep the last M) only after the new one is in place.

Model and optimizer go through get_state_dict/set_state_dict (DCP's FQN handling strips the activation-
checkpointing and compile wrappers, so a checkpoint loads whatever the AC/compile settings are). The scheduler
and data position (identical on every rank) are written by rank 0; the RNG state per rank.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.engine.checkpoint_files import DamagedCheckpoint, load_plain, write_marker
from llmctl.errors import InputError, RuntimeFailure
from llmctl.fileio import fsync_dir
from llmctl.units import fmt_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmctl.engine")

_STEP_DIR = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"
PLAN_FILE = "plan.yaml"
# Test hook: rank 0 SIGKILLs itself after the shards of this step are written but before the rename (a crash
# in the middle of a save). Only read when set; never set it in a real run.
CRASH_IN_SAVE_ENV = "LLMCTL_ENGINE_TEST_CRASH_IN_SAVE"
RNG_FORMAT = 2
"""rng-rank<R>.pt of tensors and plain numbers (format 1, before it, pickled numpy's state: refused by load_plain)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain numbers (what `torch.load(weights_only=True)` reads back):
    Python's Mersenne Twister state as a list of ints, numpy's as a tensor of its 624 key words, torch's (and CUDA's)
    as the byte tensors torch gives."""
    import random

    import numpy as np
    import torch

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": [version, list(words), gauss],
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    version, words, gauss = state["python"]
    random.setstate((int(version), tuple(int(w) for w in words), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class Checkpointer:
    root: Path
    keep_last: int
    rank: int
    plan_yaml: str = ""
    """The run's plan, written into every checkpoint (PLAN_FILE)."""
    frozen_base: dict[str, str] | None = None
    """LoRA: the frozen base's identity (llmctl.engine.lora.base_identity). The checkpoint then holds only the
    trainable parameters (the adapters) and their optimizer states, and names the base in trainer.pt; a resume on
    another base is refused."""

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if self.frozen_base is None:
            return None
        # ignore_frozen_params drops the parameters with requires_grad False; strict False because the model's own
        # load_state_dict would otherwise miss them (DCP's load still fails on any adapter the folder lacks)
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def clean_partial(self) -> None:
        """Delete folders of saves that never completed (rank 0, before anyone writes)."""
        if self.rank == 0 and self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(TMP_PREFIX) and p.is_dir():
                    log.warning("removing incomplete checkpoint %s (a save was interrupted)", p)
                    shutil.rmtree(p, ignore_errors=True)

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        trainer_state: dict[str, Any],
    ) -> Path:
        """Write the checkpoint of `step` into a temporary folder, mark it (checkpoint_files.MARKER), rename it into
        place, prune old ones. A failed write (a full disk) on any rank is one line on every rank, exit 1: the
        temporary folder is removed, the previous checkpoints are untouched."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.api import CheckpointException

        final = self.root / step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        nbytes, error = 0, None
        try:
            nbytes = self._write(tmp, model, optimizer, scheduler, trainer_state)
        except (OSError, CheckpointException) as e:  # CheckpointException is a BaseException
            error = e
        self._agree_written(tmp, error, nbytes)  # every rank's files are on disk, or every rank raises
        error = None
        if self.rank == 0:
            try:
                self._publish(step, tmp, final)
            except OSError as e:
                error = e
        self._agree_written(tmp, error, nbytes)
        return final

    def _write(
        self, tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any]
    ) -> int:
        """This rank's files in `tmp`: its DCP shards, its RNG state (rank 0: trainer.pt and plan.yaml too).
        Returns the bytes of tensor data it saves (what a full disk message says is needed)."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if hasattr(model, "state_dicts"):  # pipeline stages (llmctl.engine.pipeline): the unsplit model's
            model_sd, optim_sd = model.state_dicts(optimizer)
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
        model_sd = self._trained_only(model_sd)
        nbytes = _local_bytes(model_sd) + _local_bytes(optim_sd)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng-rank{self.rank}.pt")
        if self.rank == 0:
            base = {} if self.frozen_base is None else {"frozen_base": self.frozen_base}
            torch.save({"scheduler": scheduler.state_dict(), **state, **base}, tmp / "trainer.pt")
            if self.plan_yaml:
                (tmp / PLAN_FILE).write_text(self.plan_yaml)
        return nbytes

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        """Rank 0, every rank's files written: the marker, fsync, the atomic rename, the pruning."""
        if os.environ.get(CRASH_IN_SAVE_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        write_marker(tmp)
        for f in (f for f in tmp.rglob("*") if f.is_file()):  # durable before the rename publishes them
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (e.g. after a resume)
        os.replace(tmp, final)
        fsync_dir(self.root)
        for _, old in complete_checkpoints(self.root)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def _agree_written(self, tmp: Path, error: BaseException | None, nbytes: int) -> None:
        """A collective: returns on every rank when no rank failed; else every rank raises RuntimeFailure (rank 0
        removes the temporary folder first). A full disk names the folder and the bytes the checkpoint needs."""
        import torch
        import torch.distributed as dist

        counts = torch.tensor([0 if error is None else 1, nbytes, 1 if _no_space(error) else 0], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        failed, total, full = (int(x) for x in counts.tolist())
        if not failed:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = "; the previous checkpoints are intact"
        if full:
            free = shutil.disk_usage(self.root).free if self.root.is_dir() else 0
            raise RuntimeFailure(
                f"no space left on the device saving checkpoint {tmp}: it needs about {total:,} bytes "
                f"({fmt_bytes(total)}), {fmt_bytes(free)} free{previous}",
                hint="free space, or lower checkpoint.keep_last",
            )
        if error is None:
            raise RuntimeFailure(f"checkpoint save to {tmp} failed on another rank{previous}")
        raise RuntimeFailure(f"checkpoint save to {tmp} failed: {_cause_line(error)}{previous}")

    def read(self, path: Path) -> dict[str, Any]:
        """Every rank reads trainer.pt and its RNG file (plain data only: checkpoint_files.load_plain) and the ranks
        agree: a DamagedCheckpoint or refusal on one rank is raised on every rank (no rank left in a collective).
        Returns the trainer state, its `rng` this rank's RNG state (None: not saved for this rank)."""
        import torch.distributed as dist

        state: dict[str, Any] | None = None
        failure: tuple[str, str, str] | None = None
        try:
            state = load_plain(path / "trainer.pt")
            rng = path / f"rng-rank{self.rank}.pt"
            state["rng"] = load_plain(rng) if rng.is_file() else None
        except DamagedCheckpoint as e:
            failure = ("damaged", str(e.file), e.what)
        except InputError as e:
            failure = ("refused", e.message, e.hint or "")
        failures: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        first = next((f for f in failures if f is not None), None)
        if first is not None:
            kind, a, b = first
            raise DamagedCheckpoint(Path(a), b) if kind == "damaged" else InputError(a, hint=b or None)
        assert state is not None
        return state

    def load(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, trainer: dict
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and this rank's RNG from `path` (`trainer`: what `read` returned);
        returns the trainer state (step, data). A DCP load failure (any rank) is a DamagedCheckpoint on every rank."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options = self._options()
        staged = hasattr(model, "state_dicts")  # pipeline stages (llmctl.engine.pipeline): the unsplit model's
        model_sd, optim_sd = (
            model.state_dicts(optimizer) if staged else get_state_dict(model, optimizer, options=options)
        )
        state = {"model": self._trained_only(model_sd), "optim": optim_sd}
        self._check_base(path, trainer.get("frozen_base"))
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure and raises it on all
            raise DamagedCheckpoint(path, f"cannot be loaded ({_cause_line(e)})", folder=path) from None
        if staged:
            model.load_state_dicts(optimizer, state["model"], state["optim"])
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
            )
        scheduler.load_state_dict(trainer.pop("scheduler"))
        rng = trainer.pop("rng", None)
        if rng is not None:
            set_rng_state(rng)
        else:
            log.warning("%s has no RNG state for rank %d (different world size); RNG not restored", path, self.rank)
        return trainer

    def _trained_only(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        """LoRA: the adapters only. ignore_frozen_params keeps a tied weight under its second name (GPT-2's
        lm_head.weight is the frozen wte.weight: torch filters named_parameters(), which lists it once)."""
        if self.frozen_base is None:
            return model_sd
        from llmctl.engine.lora import is_adapter

        return {k: v for k, v in model_sd.items() if is_adapter(k)}

    def _check_base(self, path: Path, saved: dict[str, str] | None) -> None:
        """A LoRA run resumes only adapters trained on its own base; a full run refuses a LoRA checkpoint (it
        holds no base weights) and the other way round."""
        from llmctl.errors import SpecError

        if self.frozen_base is not None:
            from llmctl.engine.lora import check_base

            check_base(saved, self.frozen_base, f"checkpoint {path}")
        elif saved is not None:
            raise SpecError(
                f"checkpoint {path} holds LoRA adapters only (base: {saved.get('base')}), not a full model",
                hint="resume it with its plan's finetune section, or use a new checkpoint.dir",
            )


class StopSignal:
    """SIGTERM/SIGUSR1 (SLURM preemption, torchrun shutdown) set a flag; ranks agree at step boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signum

    def agreed(self) -> bool:
        """True on every rank if any rank got a signal (a MAX all-reduce of one CPU int: gloo, no GPU sync)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _local_bytes(state: Any) -> int:
    """Bytes of this rank's tensor data in a (nested) state dict: its local shards of DTensors."""
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_local_bytes(v) for v in state)
    local = getattr(state, "to_local", None)
    t = local() if callable(local) else state
    numel, size = getattr(t, "numel", None), getattr(t, "element_size", None)
    return int(numel() * size()) if callable(numel) and callable(size) else 0


def _causes(e: BaseException | None) -> list[BaseException]:
    """`e`, the exceptions a CheckpointException gathered from the ranks, and their causes."""
    out: list[BaseException] = []
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, x.__context__]
    return out


def _no_space(e: BaseException | None) -> bool:
    import errno

    return any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in _causes(e))


def _cause_line(e: BaseException) -> str:
    """The first line of the innermost failure (a CheckpointException's text is every rank's traceback)."""
    inner = [x for x in _causes(e) if type(x).__name__ != "CheckpointException"]
    x = inner[0] if inner else e
    if type(x).__name__ == "UnpicklingError":  # torch's text goes on to suggest weights_only=False: not here
        return "UnpicklingError: an entry that is corrupt or not plain data"
    lines = str(x).strip().splitlines()
    return f"{type(x).__name__}: {lines[0][:200]}" if lines else type(x).__name__
