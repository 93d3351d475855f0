"""The collectives llmctl models and measures: one registry shared by the planner's cost model
(`llmctl.plan.comm`) and bench-net (`llmctl.netbench`). Torch-free.

Each entry is what both sides must agree on, in nccl-tests' terms (NVIDIA/nccl-tests doc/PERFORMANCE.md):
- S, the size a measurement is quoted at: the all-reduce buffer, the all-gather *output*, the reduce-scatter *input*;
- the bus factor, busbw / algbw with algbw = S / t: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
  reduce-scatter, so that busbw is what each link sustains whatever n is;
- the latency steps of the alpha-beta model.
How to call a collective and check its result needs torch: that half lives in `llmctl.netbench.worker.CALLS`, keyed
by the same names. A new collective is one entry here and one there (a test checks that the keys agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from llmctl.errors import InputError


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective, as nccl-tests defines its bandwidth."""

    name: str
    """torch.distributed's name (all_reduce, all_gather, reduce_scatter)."""
    bus_factor: Callable[[int], float]
    """n ranks -> busbw / algbw."""
    ring_steps: Callable[[int], int]
    """n ranks (n >= 2) -> latency terms of one call (the alpha of alpha-beta)."""
    size_counts: Literal["buffer", "output", "input"]
    """Which tensor S counts: each rank's in-place buffer, or the full (n-chunk) output or input."""


def _ring_factor(n: int) -> float:
    # all-gather / reduce-scatter: each rank sends and receives (n-1) of the n chunks of S
    return (n - 1) / n


def _all_reduce_factor(n: int) -> float:
    # a reduce-scatter then an all-gather of the same S: twice (n-1)/n
    return 2 * (n - 1) / n


def _ring_steps(n: int) -> int:
    # a ring all-gather / reduce-scatter takes n-1 steps (Thakur et al. 2005)
    return n - 1


def _all_reduce_steps(n: int) -> int:
    # 2(n-1) on a ring; NCCL switches to its double binary tree at scale (2 log2 n hops, NCCL 2.4 release notes)
    return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))


# Order matters: it is the order bench-net sweeps, reports and prints the collectives in.
REGISTRY: dict[str, CollectiveSpec] = {
    c.name: c
    for c in (
        CollectiveSpec("all_reduce", _all_reduce_factor, _all_reduce_steps, "buffer"),
        CollectiveSpec("all_gather", _ring_factor, _ring_steps, "output"),
        CollectiveSpec("reduce_scatter", _ring_factor, _ring_steps, "input"),
    )
}
COLLECTIVES: tuple[str, ...] = tuple(REGISTRY)


def collective(name: str) -> CollectiveSpec:
    """The registry entry; InputError naming the valid ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise InputError(f"unknown collective {name!r}", hint="one of: " + ", ".join(COLLECTIVES)) from None


def bus_factor(name: str, n_ranks: int) -> float:
    """nccl-tests busbw/algbw: (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce."""
    if n_ranks < 1:
        raise InputError(f"a collective needs at least 1 rank, got {n_ranks}")
    return collective(name).bus_factor(n_ranks)


def ring_steps(name: str, n_ranks: int) -> int:
    """Latency terms of one call over n ranks; 0 for a single rank (nothing moves)."""
    spec = collective(name)
    return 0 if n_ranks <= 1 else spec.ring_steps(n_ranks)
