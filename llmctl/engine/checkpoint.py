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

from llmctl.errors import RuntimeFailure
from llmctl.fileio import fsync_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmctl.engine")

_STEP_DIR = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"
PLAN_FILE = "plan.yaml"
# Test hook: rank 0 SIGKILLs itself after the shards of this step are written but before the rename (a crash
# in the middle of a save). Only read when set; never set it in a real run.
CRASH_IN_SAVE_ENV = "LLMCTL_ENGINE_TEST_CRASH_IN_SAVE"


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
    import random

    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        final = self.root / step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        try:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=self._options())
            model_sd = self._trained_only(model_sd)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
            torch.save(rng_state(), tmp / f"rng-rank{self.rank}.pt")
            if self.rank == 0:
                base = {} if self.frozen_base is None else {"frozen_base": self.frozen_base}
                torch.save({"scheduler": scheduler.state_dict(), **trainer_state, **base}, tmp / "trainer.pt")
                if self.plan_yaml:
                    (tmp / PLAN_FILE).write_text(self.plan_yaml)
        except OSError as e:
            raise RuntimeFailure(f"checkpoint save to {tmp} failed: {e}") from None
        dist.barrier()  # every rank's shards are on disk
        if self.rank == 0:
            if os.environ.get(CRASH_IN_SAVE_ENV) == str(step):
                os.kill(os.getpid(), signal.SIGKILL)
            for f in (f for f in tmp.rglob("*") if f.is_file()):  # durable before the rename publishes them
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (e.g. after a resume)
            os.replace(tmp, final)
            fsync_dir(self.root)
            for _, old in complete_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(
        self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and this rank's RNG; returns the trainer state (step, data)."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        options = self._options()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": self._trained_only(model_sd), "optim": optim_sd}
        try:
            trainer = torch.load(path / "trainer.pt", weights_only=False)
        except Exception as e:  # a truncated or foreign file
            raise RuntimeFailure(
                f"cannot load checkpoint {path}: {type(e).__name__}: {str(e)[:300]}",
                hint="move it aside to start from the previous one",
            ) from None
        self._check_base(path, trainer.get("frozen_base"))
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # DCP raises several types for a mismatched or corrupt checkpoint
            raise RuntimeFailure(
                f"cannot load checkpoint {path}: {type(e).__name__}: {str(e)[:300]}",
                hint="move it aside to start from the previous one",
            ) from None
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
        scheduler.load_state_dict(trainer.pop("scheduler"))
        rng = path / f"rng-rank{self.rank}.pt"
        if rng.is_file():
            set_rng_state(torch.load(rng, weights_only=False))
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
