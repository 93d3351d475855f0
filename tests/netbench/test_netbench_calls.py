"""The torch half of the collective registry (`llmctl.netbench.worker.CALLS`) agrees with the torch-free half
(`llmctl.spec.collectives`): the same names in the same order, and each entry's tensors count the size S the
spec says nccl-tests counts. No process group needed."""

from __future__ import annotations

import pytest
import torch

from llmctl.netbench import worker
from llmctl.spec.collectives import COLLECTIVES, collective


def test_calls_are_keyed_like_the_spec_registry() -> None:
    assert tuple(worker.CALLS) == COLLECTIVES


@pytest.mark.parametrize("name", COLLECTIVES)
def test_call_tensors_count_the_size_the_spec_names(name: str) -> None:
    n, numel = 4, 32
    inp, out = worker.CALLS[name].tensors(numel, n, 1, torch.float32, torch.device("cpu"))
    counts = collective(name).size_counts
    counted = {"buffer": out, "output": out, "input": inp}[counts]
    assert counted.numel() == numel
    assert (inp is out) == (counts == "buffer")  # only an in-place collective counts one buffer
    assert {inp.numel(), out.numel()} <= {numel, numel // n}  # the other side is one rank's chunk


def test_checks_tell_right_from_wrong() -> None:
    n = 4
    calls = worker.CALLS
    assert calls["all_reduce"].check(torch.full((8,), 4.0), n)
    assert not calls["all_reduce"].check(torch.full((8,), 3.0), n)
    gathered = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(2)  # rank r's chunk holds r + 1
    assert calls["all_gather"].check(gathered, n)
    assert not calls["all_gather"].check(gathered.flip(0), n)
    assert calls["reduce_scatter"].check(torch.full((2,), 4.0), n)
    assert not calls["reduce_scatter"].check(torch.full((2,), 1.0), n)
