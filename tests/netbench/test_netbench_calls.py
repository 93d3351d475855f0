"""The torch half of the collective registry (`llmctl.netbench.calls.CALLS`) agrees with the torch-free half
(`llmctl.spec.collectives`): the same names in the same order, and each entry's tensors count the size S the
spec says nccl-tests counts. No process group needed."""

from __future__ import annotations

import pytest
import torch

from llmctl.netbench import calls as nc
from llmctl.spec.collectives import COLLECTIVES, collective

CPU = torch.device("cpu")


def test_calls_are_keyed_like_the_spec_registry() -> None:
    assert tuple(nc.CALLS) == COLLECTIVES


@pytest.mark.parametrize("name", COLLECTIVES)
def test_call_tensors_count_the_size_the_spec_names(name: str) -> None:
    n, numel = 4, 32
    inp, out = nc.CALLS[name].tensors(numel, n, 1, torch.float32, torch.device("cpu"))
    counts = collective(name).size_counts
    counted = {"buffer": out, "output": out, "input": inp, "send": inp}[counts]
    assert counted.numel() == numel
    assert (inp is out) == (counts == "buffer")  # only an in-place collective counts one buffer
    if counts == "send":  # nccl-tests sendrecv: each rank sends S and receives S
        assert inp.numel() == out.numel() == numel
    else:
        assert {inp.numel(), out.numel()} <= {numel, numel // n}  # the other side is one rank's chunk


def test_checks_tell_right_from_wrong() -> None:
    n, rank = 4, 1
    calls = nc.CALLS
    assert calls["all_reduce"].check(torch.full((8,), 4.0), n, rank)
    assert not calls["all_reduce"].check(torch.full((8,), 3.0), n, rank)
    gathered = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(2)  # rank r's chunk holds r + 1
    assert calls["all_gather"].check(gathered, n, rank)
    assert not calls["all_gather"].check(gathered.flip(0), n, rank)
    assert calls["reduce_scatter"].check(torch.full((2,), 4.0), n, rank)
    assert not calls["reduce_scatter"].check(torch.full((2,), 1.0), n, rank)
    # send_recv: rank r holds r + 1 and receives from r - 1 (ring), so rank 1 sees 1 and rank 0 sees n
    assert calls["send_recv"].check(torch.full((8,), 1.0), n, 1)
    assert calls["send_recv"].check(torch.full((8,), float(n)), n, 0)
    assert not calls["send_recv"].check(torch.full((8,), 3.0), n, 1)  # from rank + 1: the wrong direction
    assert not calls["send_recv"].check(torch.full((8,), 2.0), n, 1)  # its own buffer, never sent
    # all_to_all: rank r's chunk for rank j holds r x n + j + 1, so rank 1 receives 2, 6, 10, 14
    received = torch.tensor([2.0, 6.0, 10.0, 14.0]).repeat_interleave(2)
    assert calls["all_to_all"].check(received, n, 1)
    assert not calls["all_to_all"].check(received, n, 2)  # rank 2's chunks: sent to the wrong rank
    assert not calls["all_to_all"].check(nc.CALLS["all_to_all"].tensors(8, n, 1, torch.float32, CPU)[0], n, 1)


def test_all_to_all_sends_a_chunk_to_each_rank() -> None:
    """Rank 2 of 4: chunk j (of 4 elements) goes to rank j and holds 2 x 4 + j + 1; the output receives as much."""
    inp, out = nc.CALLS["all_to_all"].tensors(16, 4, 2, torch.bfloat16, CPU)
    assert inp.dtype == out.dtype == torch.bfloat16 and out.numel() == 16
    assert inp.view(4, 4)[:, 0].tolist() == [9.0, 10.0, 11.0, 12.0]


def test_send_recv_sends_its_rank_id() -> None:
    inp, out = nc.CALLS["send_recv"].tensors(16, 4, 2, torch.bfloat16, torch.device("cpu"))
    assert inp.dtype == out.dtype == torch.bfloat16 and bool((inp == 3).all()) and inp is not out
