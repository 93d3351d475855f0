"""Live tensor memory of a training step, measured on any device (the CPU has no allocator statistics).

`LiveBytes` is a TorchDispatchMode that sees every tensor an op creates (forward, backward, recomputation under
activation checkpointing, and the outputs selective checkpointing caches), tracks the storages by weak reference and
sums the ones still alive. After forward that sum is exactly what the step holds for backward, whatever holds it
(autograd's saved tensors, a checkpoint's inputs, selective checkpointing's cache); its running maximum, sampled
after every op, is the peak the allocator would see (an op's outputs are allocated while its inputs are alive).
Storages that existed before the mode (parameters, buffers, the batch) are never counted.

Used by the memory model's tests (tests/plan/test_memory_checkpointing.py) and benchmarks/checkpointing.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self, ignore: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self._ignore = {StorageWeakRef(t.untyped_storage()).cdata for t in ignore or ()}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        self.peak = max(self.peak, self.live())
        return out

    def _track(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        ref = StorageWeakRef(s)
        if ref.cdata in self._ignore:
            return
        old = self._live.get(ref.cdata)
        if old is None or old[0].expired():
            self._live[ref.cdata] = (ref, s.nbytes())

    def live(self) -> int:
        """Bytes of the tracked storages still alive."""
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            del self._live[k]
        return sum(n for _, n in self._live.values())

    def reset_peak(self) -> None:
        self.peak = self.live()


@dataclass(frozen=True)
class StepMemory:
    saved_bytes: int
    """Held after forward, for backward (the loss scalar aside)."""
    forward_peak_bytes: int
    backward_peak_bytes: int
    """Peak during backward, parameter gradients included."""


def measure_step(model: torch.nn.Module, forward: Callable[[], torch.Tensor], *keep: Any) -> StepMemory:
    """Run forward() -> loss and its backward under LiveBytes. `forward` must not keep intermediates alive (write it
    as a function whose locals die when it returns); `keep` names other tensors that existed before (the batch)."""
    ignore = [*model.parameters(), *model.buffers(), *(k for k in keep if isinstance(k, torch.Tensor))]
    with LiveBytes(ignore) as m:
        loss = forward()
        saved = m.live() - loss.untyped_storage().nbytes()
        fwd_peak = m.peak
        m.reset_peak()
        loss.backward()
        bwd_peak = m.peak
    return StepMemory(saved, fwd_peak, bwd_peak)
