"""The collectives llmctl models and measures: one registry shared by the planner's cost model
(`llmctl.plan.comm`) and bench-net (`llmctl.netbench`). Torch-free.

Each entry is what both sides must agree on, in nccl-tests' terms (NVIDIA/nccl-tests doc/PERFORMANCE.md):
- S, the size a measurement is quoted at: the all-reduce buffer, the all-gather *output*, the reduce-scatter *input*,
  what each rank sends (and receives) in a ring send/recv, and in an all-to-all (its n chunks, its own included);
- the bus factor, busbw / algbw with algbw = S / t: 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
  reduce-scatter and all-to-all, 1 for send/recv, so that busbw is what each link sustains whatever n is;
- the latency steps of the alpha-beta model.
How to call a collective and check its result needs torch: that half lives in `llmctl.netbench.calls.CALLS`, keyed
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
    """torch.distributed's name (all_reduce, all_gather, reduce_scatter, all_to_all); send_recv for nccl-tests'
    sendrecv_perf."""
    bus_factor: Callable[[int], float]
    """n ranks -> busbw / algbw."""
    ring_steps: Callable[[int], int]
    """n ranks (n >= 2) -> latency terms of one call (the alpha of alpha-beta)."""
    size_counts: Literal["buffer", "output", "input", "send"]
    """Which tensor S counts: each rank's in-place buffer, the full (n-chunk) output or input, or what each rank
    sends (and, at the same time, receives)."""


def _ring_factor(n: int) -> float:
    # all-gather / reduce-scatter: each rank sends and receives (n-1) of the n chunks of S
    return (n - 1) / n


def _all_reduce_factor(n: int) -> float:
    # a reduce-scatter then an all-gather of the same S: twice (n-1)/n
    return 2 * (n - 1) / n


def _send_recv_factor(n: int) -> float:
    # nccl-tests sendrecv_perf: rank r sends S to r+1 while it receives S from r-1; every link carries S, whatever n
    return 1.0


def _all_to_all_factor(n: int) -> float:
    # nccl-tests alltoall_perf: S is what each rank sends, n chunks of S/n, one to every rank, itself included; the
    # chunk it keeps never leaves it, so each rank's links carry all but 1/n of S out, and as much in
    return 1 - 1 / n


def _ring_steps(n: int) -> int:
    # a ring all-gather / reduce-scatter takes n-1 steps (Thakur et al. 2005)
    return n - 1


def _all_reduce_steps(n: int) -> int:
    # 2(n-1) on a ring; NCCL switches to its double binary tree at scale (2 log2 n hops, NCCL 2.4 release notes)
    return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))


def _send_recv_steps(n: int) -> int:
    # one hop: every rank's send and receive run at once (ring attention's rotation repeats it cp-1 times)
    return 1


def _all_to_all_steps(n: int) -> int:
    # pairwise exchange: one message to each of the n-1 peers (Thakur et al. 2005; NCCL posts them in one group)
    return n - 1


# Order matters: it is the order bench-net sweeps, reports and prints the collectives in.
REGISTRY: dict[str, CollectiveSpec] = {
    c.name: c
    for c in (
        CollectiveSpec("all_reduce", _all_reduce_factor, _all_reduce_steps, "buffer"),
        CollectiveSpec("all_gather", _ring_factor, _ring_steps, "output"),
        CollectiveSpec("reduce_scatter", _ring_factor, _ring_steps, "input"),
        # context parallelism's ring attention passes keys/values to the next rank of the cp group
        CollectiveSpec("send_recv", _send_recv_factor, _send_recv_steps, "send"),
        # expert parallelism's token dispatch and combine: every rank sends a chunk to every rank of the ep group
        CollectiveSpec("all_to_all", _all_to_all_factor, _all_to_all_steps, "send"),
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
    """nccl-tests busbw/algbw: (n-1)/n for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce, 1 for
    send/recv."""
    if n_ranks < 1:
        raise InputError(f"a collective needs at least 1 rank, got {n_ranks}")
    return collective(name).bus_factor(n_ranks)


def ring_steps(name: str, n_ranks: int) -> int:
    """Latency terms of one call over n ranks; 0 for a single rank (nothing moves)."""
    spec = collective(name)
    return 0 if n_ranks <= 1 else spec.ring_steps(n_ranks)
