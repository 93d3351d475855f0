"""The torch half of the collectives registry: for each entry of `llmctl.spec.collectives`, the tensors one call
needs, the call, and the check of its result. The worker (`llmctl.netbench.worker`) binds them to a group and times
them; a new collective is one entry of `CALLS` here and one of the spec's registry (a test checks that the keys
agree).

Imports torch: only the worker and the tests import this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 deprecates the *_into_tensor/_tensor names for *_single; keep older torch working too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CollectiveCall:
    """The torch half of a `llmctl.spec.collectives` entry: the tensors one call needs, the call, its check.

    The size S given to `tensors` is the one the spec's `size_counts` names (nccl-tests' convention), in elements."""

    tensors: Callable[[int, int, int, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]]
    """(S elements, n ranks, this rank in the group, dtype, device) -> (input, output), filled so that `check` can
    tell a right result from a wrong one; the same tensor twice for an in-place collective."""
    call: Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], object]
    """(input, output, group): one call."""
    check: Callable[[torch.Tensor, int, int], bool]
    """(output of the first call, n ranks, this rank in the group) -> whether it is right."""


# Integers a 16-bit float holds exactly: beyond, a ring's running sum of ones stalls (256 + 1 == 256 in bf16).
_EXACT_INT = {torch.bfloat16: 256, torch.float16: 2048}


def _sum_of_ones_ok(result: torch.Tensor, n: int, rank: int) -> bool:
    """Every element is the sum of n ones. Past a 16-bit type's exact range the order of additions changes the
    rounded value, so there: equal everywhere, finite, and at least the exact range's sum."""
    limit = _EXACT_INT.get(result.dtype, 2**24)
    if n <= limit:
        return torch.allclose(result, torch.full_like(result, n), rtol=0.0, atol=0.5)  # exact integers
    first = result.flatten()[0]
    return bool(torch.isfinite(first)) and float(first) >= 0.99 * limit and bool((result == first).all())


def _rank_ids_ok(result: torch.Tensor, n: int, rank: int) -> bool:
    """The gathered output holds rank r's chunk, all r + 1, at chunk r."""
    expected = torch.arange(1, n + 1, dtype=result.dtype, device=result.device).repeat_interleave(result.numel() // n)
    return torch.allclose(result, expected, rtol=1e-2)


def _from_previous_ok(result: torch.Tensor, n: int, rank: int) -> bool:
    """A ring send/recv: rank r received rank r-1's buffer, all (r-1 mod n) + 1. Rank ids up to n stay exact in
    16-bit floats for any group bench-net forms on one ring (bf16 holds integers to 256; rtol covers beyond)."""
    return torch.allclose(result, torch.full_like(result, (rank - 1) % n + 1), rtol=1e-2)


def _chunk_ids_ok(result: torch.Tensor, n: int, rank: int) -> bool:
    """An all-to-all: rank r's output chunk i is the chunk rank i addressed to r, which holds i x n + r + 1. The ids
    stay exact in 16-bit floats up to n = 16 (bf16 holds integers to 256); rtol covers beyond, as for the gather."""
    ids = torch.arange(n, dtype=torch.float64) * n + rank + 1
    expected = ids.to(result.dtype).to(result.device).repeat_interleave(result.numel() // n)
    return torch.allclose(result, expected, rtol=1e-2)


def _all_reduce_tensors(
    numel: int, n: int, rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.ones(numel, dtype=dtype, device=device)  # S is the buffer, reduced in place
    return buf, buf


def _all_gather_tensors(
    numel: int, n: int, rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # S is the output; each rank sends S/n elements holding its rank + 1, so the output shows who sent what
    inp = torch.full((numel // n,), rank + 1, dtype=dtype, device=device)
    return inp, torch.empty(numel, dtype=dtype, device=device)


def _reduce_scatter_tensors(
    numel: int, n: int, rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # S is the input: n chunks of ones; each rank keeps one chunk, the sum of n ones
    return torch.ones(numel, dtype=dtype, device=device), torch.empty(numel // n, dtype=dtype, device=device)


def _send_recv_tensors(
    numel: int, n: int, rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # S is what each rank sends (its rank + 1 everywhere) and, at the same time, receives from the previous rank
    return torch.full((numel,), rank + 1, dtype=dtype, device=device), torch.empty(numel, dtype=dtype, device=device)


def _ring_send_recv(inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> None:
    """nccl-tests sendrecv_perf on a ring: send S to rank r+1 while receiving S from rank r-1, one batch (NCCL
    groups the pair, so two ranks that send to each other do not wait on each other's send; gloo posts both)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    ops = [
        dist.P2POp(dist.isend, inp, group=group, group_peer=(rank + 1) % n),
        dist.P2POp(dist.irecv, out, group=group, group_peer=(rank - 1) % n),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _all_to_all_tensors(
    numel: int, n: int, rank: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # S is what each rank sends: n chunks of S/n, chunk j for rank j holding rank x n + j + 1 (one id per sender and
    # receiver, so the check sees a chunk sent to the wrong rank as well as one from the wrong rank)
    ids = torch.arange(n, dtype=torch.float64) + rank * n + 1
    inp = ids.to(dtype).to(device).repeat_interleave(numel // n)
    return inp, torch.empty(numel, dtype=dtype, device=device)


def _all_to_all(inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> None:
    """nccl-tests alltoall_perf: even splits (no split sizes), which gloo runs as NCCL does."""
    dist.all_to_all_single(out, inp, group=group)


# Keyed and ordered like llmctl.spec.collectives.REGISTRY (a test checks that the keys agree).
CALLS: dict[str, CollectiveCall] = {
    "all_reduce": CollectiveCall(
        _all_reduce_tensors, lambda inp, out, group: dist.all_reduce(out, group=group), _sum_of_ones_ok
    ),
    "all_gather": CollectiveCall(
        _all_gather_tensors, lambda inp, out, group: _all_gather(out, inp, group=group), _rank_ids_ok
    ),
    "reduce_scatter": CollectiveCall(
        _reduce_scatter_tensors, lambda inp, out, group: _reduce_scatter(out, inp, group=group), _sum_of_ones_ok
    ),
    "send_recv": CollectiveCall(_send_recv_tensors, _ring_send_recv, _from_previous_ok),
    "all_to_all": CollectiveCall(_all_to_all_tensors, _all_to_all, _chunk_ids_ok),
}


@dataclass(frozen=True)
class BoundCall:
    """One collective on one group with its tensors: what `Timer.measure` runs."""

    run: Callable[[], object]
    check: Callable[[], bool]
    reset: Callable[[], object]
    """After the check: an in-place collective reduces into its input, so zero it (sums of zeros stay zero,
    however many calls follow); a no-op otherwise."""


def bind(
    collective: str, size_bytes: int, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device
) -> BoundCall:
    """`collective` on `group` (this rank a member) at nccl-tests size S = size_bytes, already split evenly
    (`aligned_size`): the tensors are made once, here, and reused by every timed call."""
    call = CALLS[collective]
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    inp, out = call.tensors(size_bytes // dtype.itemsize, n, rank, dtype, device)
    return BoundCall(
        run=functools.partial(call.call, inp, out, group),
        check=functools.partial(call.check, out, n, rank),
        reset=inp.zero_ if inp is out else _nothing,
    )


def _nothing() -> None:
    pass
