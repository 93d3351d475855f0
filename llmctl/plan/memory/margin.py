"""The memory margin: how much of each GPU a setup leaves free beyond what the estimate holds (torch-free).

The estimate (llmctl.plan.memory.estimate) predicts torch.cuda.max_memory_allocated, adds the caching allocator's
headroom (10% of it: reserved bytes) and the CUDA context with one NCCL communicator (1 GiB: what nvidia-smi shows).
What it cannot see is measured, and the default margin is the sum of the two:

- Fragmentation beyond the 10% headroom. On one H100 80GB (docs/measurements/h100-gpu-tier.json, `memory/*`: seven
  Llama-3.2-1B setups, torch 2.11) reserved bytes exceeded 1.10 x the peak allocated by up to 4.20 GiB (`mb8-full`:
  39.21 GiB allocated, 47.34 reserved, ratio 1.21; full checkpointing frees and re-allocates each block's activations,
  the pattern that fragments most), 5.3% of the GPU's 79.6 GiB.
- NCCL buffers of a second communicator (HSDP's replicate group, TP, CP: the 1 GiB context line holds one). NCCL
  allocates NCCL_BUFFSIZE (4 MiB, NCCL's environment-variable docs) per channel and peer for each protocol it
  sets up; about 0.2-0.5 GiB per communicator (llmctl.spec.setup's context note): 0.5 GiB is 0.6% of an 80 GB GPU.

5.3% + 0.6% rounds to DEFAULT_MEMORY_MARGIN = 6%. Planned at that, a default pick never warns; a margin asked below it
(--memory-margin 0) warns when the pick leaves less free (tests/plan/test_memory_margin.py holds the figure against
the measurement file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmctl.units import GIB

DEFAULT_MEMORY_MARGIN = 0.06
"""Fraction of each GPU's memory kept free by default (plan and estimate-memory's --memory-margin): the module
docstring's derivation from the H100's measured fragmentation and NCCL's buffers."""
MARGIN_SOURCE = (
    "fragmentation beyond the allocator headroom measured on an H100 (up to 4.2 GiB, "
    "docs/measurements/h100-gpu-tier.json) and a second NCCL communicator's buffers (0.5 GiB)"
)
"""What the default margin covers, as the output names it."""


@dataclass(frozen=True)
class Margin:
    """The margin a request keeps free on a GPU of `gpu_bytes`."""

    fraction: float
    gpu_bytes: int

    @property
    def bytes(self) -> int:
        return self.gpu_bytes - self.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the GPU a setup may use."""
        return int(self.gpu_bytes * (1 - self.fraction))

    @property
    def is_default(self) -> bool:
        return self.fraction == DEFAULT_MEMORY_MARGIN

    def line(self) -> str:
        """'margin 4.8 GiB (6%) kept free: fragmentation ...' (the default), or as asked with --memory-margin."""
        head = f"margin {self.bytes / GIB:.1f} GiB ({self.fraction:.0%}) kept free"
        if self.is_default:
            return f"{head}: {MARGIN_SOURCE}"
        under = f", under the default {DEFAULT_MEMORY_MARGIN:.0%}" if self.fraction < DEFAULT_MEMORY_MARGIN else ""
        return f"{head} as asked (--memory-margin {self.fraction:g}){under}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "fraction": self.fraction,
            "bytes": self.bytes,
            "capacity_bytes": self.capacity_bytes,
            "default_fraction": DEFAULT_MEMORY_MARGIN,
            "line": self.line(),
        }


def tight_warning(free_bytes: int, gpu_bytes: int, margin: float, headroom_fraction: float) -> str | None:
    """A warning when the setup leaves less free than the default margin and a smaller margin was asked for (a pick
    at the default margin never warns: the threshold and the default are one figure)."""
    if margin >= DEFAULT_MEMORY_MARGIN or free_bytes >= DEFAULT_MEMORY_MARGIN * gpu_bytes:
        return None
    return (
        f"the chosen setup leaves {free_bytes / GIB:.1f} GiB ({free_bytes / gpu_bytes:.1%}) of the "
        f"{gpu_bytes / GIB:.1f} GiB free, under the default margin of {DEFAULT_MEMORY_MARGIN:.0%}: the fragmentation "
        f"measured beyond the {headroom_fraction:.0%} headroom on an H100, or a CUDA or NCCL stack with larger "
        f"workspaces than assumed, would run out of memory; without --memory-margin the planner keeps "
        f"{DEFAULT_MEMORY_MARGIN:.0%} free"
    )
