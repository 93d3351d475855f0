"""Golden numbers and invariants of the alpha-beta communication model (llmctl.plan.comm)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.spec import collectives
from llmctl.spec.parallel import ParallelDims

P7B = 6_738_415_616  # Llama-2-7B parameters


def test_bus_factors_are_nccl_tests() -> None:
    assert collectives.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert collectives.bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert collectives.bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert collectives.bus_factor("all_reduce", 1) == 0
    with pytest.raises(InputError, match="unknown collective"):
        collectives.bus_factor("broadcast", 4)


def test_collective_time_alpha_beta() -> None:
    # 1 GB all-gathered over 4 ranks at 100 GB/s busbw: 0.75 GB / 100 GB/s = 7.5 ms, + 3 ring steps x 10 us.
    assert cm.collective_time_s("all_gather", 4, 1e9, 100.0, 10e-6) == pytest.approx(7.5e-3 + 30e-6)
    # all-reduce: 2(n-1)/n; latency min(ring 2(n-1), tree 2 log2 n) steps
    assert cm.collective_time_s("all_reduce", 4, 1e9, 100.0, 10e-6) == pytest.approx(15e-3 + 40e-6)
    assert collectives.ring_steps("all_reduce", 2) == 2 and collectives.ring_steps("all_reduce", 1024) == 20
    assert collectives.ring_steps("all_gather", 1024) == 1023
    assert cm.collective_time_s("all_reduce", 1, 1e9, 100.0) == 0.0


def step(strategy: str, shape: cm.CommShape, nodes: int, gpus_per_node: int, *args, **kwargs) -> cm.StepComm:
    """step_comm for a strategy's degrees (the planner's path: strategy -> ParallelDims -> collectives per axis)."""
    dims = ParallelDims.from_strategy(strategy, nodes, gpus_per_node)
    return cm.step_comm(dims, shape, gpus_per_node, *args, **kwargs)


SEED_NET = cm.Network(intra_gbytes_s=240.0, inter_node_gbytes_s=50 / 8, alpha_intra_s=0, alpha_inter_s=0)
SHAPE = cm.CommShape(params=P7B, num_layers=32)


def test_full_shard_over_two_nodes_moves_three_passes_over_the_nic() -> None:
    """Seed setup: per micro-batch, bf16 all-gather in forward and backward + fp32 reduce-scatter, 7/8 over 6.25 GB/s."""
    c = step("full_shard", SHAPE, nodes=2, gpus_per_node=4, grad_accum=1, fwd_s=0, bwd_s=0, net=SEED_NET)
    ag = P7B * 2 * 7 / 8 / 6.25e9
    rs = P7B * 4 * 7 / 8 / 6.25e9
    assert c.total_s == pytest.approx(2 * ag + rs)  # ~7.55 s
    assert c.exposed_s == pytest.approx(c.total_s)  # nothing to hide behind
    assert {o.scope for o in c.ops} == {"cross"}
    # grad accumulation repeats every pass per micro-batch
    c4 = step("full_shard", SHAPE, 2, 4, 4, 0, 0, SEED_NET)
    assert c4.total_s == pytest.approx(4 * c.total_s)


def test_hybrid_keeps_gathers_inside_the_node_and_all_reduces_the_shard_once() -> None:
    c = step("hybrid_shard", SHAPE, 2, 4, grad_accum=4, fwd_s=0, bwd_s=0, net=SEED_NET)
    inter = [o for o in c.ops if o.scope == "inter"]
    assert len(inter) == 1 and inter[0].calls_per_step == 32
    # the fp32 shard (P/4 x 4 bytes) all-reduced over 2 nodes (factor 1) on 1/4 of the NIC each: 4.31 s per step
    assert inter[0].time_per_step_s == pytest.approx(P7B / 4 * 4 * 1.0 / (6.25e9 / 4))
    intra = [o for o in c.ops if o.scope == "intra"]
    assert intra and all(o.calls_per_step == 32 * 4 for o in intra)


def test_no_shard_all_reduces_the_gradients_once_per_step() -> None:
    c = step("no_shard", SHAPE, 1, 8, grad_accum=8, fwd_s=0, bwd_s=0, net=SEED_NET)
    assert len(c.ops) == 1 and c.ops[0].collective == "all_reduce"
    assert c.total_s == pytest.approx(P7B * 4 * 2 * 7 / 8 / 240e9)


def test_overlap_is_a_parameter() -> None:
    args = ("full_shard", SHAPE, 2, 4, 1, 10.0, 20.0, SEED_NET)
    total = step(*args, overlap=0.0).total_s
    assert step(*args, overlap=0.0).exposed_s == pytest.approx(total)
    assert step(*args, overlap=1.0).exposed_s == pytest.approx(0.0)  # 7.55 s hides behind 30 s
    half = step(*args, overlap=0.5).exposed_s
    assert half == pytest.approx(total / 2)
    with pytest.raises(InputError, match="overlap"):
        step(*args, overlap=1.5)


def test_multi_node_without_inter_node_bandwidth_is_one_clear_error() -> None:
    with pytest.raises(InputError, match="no inter-node bandwidth"):
        step("full_shard", SHAPE, 2, 4, 1, 1, 1, cm.Network(240.0, None))


@settings(max_examples=150, deadline=None)
@given(
    strategy=st.sampled_from(["full_shard", "hybrid_shard", "no_shard"]),
    nodes=st.integers(2, 64),
    g=st.sampled_from([1, 2, 4, 8]),
    accum=st.integers(1, 16),
    fwd=st.floats(0, 20),
    bwd=st.floats(0, 40),
    intra=st.floats(1, 1000),
    inter=st.floats(0.1, 1000),
    factor=st.floats(1, 100),
    overlap=st.floats(0, 1),
)
def test_more_bandwidth_never_predicts_more_exposed_communication(
    strategy, nodes, g, accum, fwd, bwd, intra, inter, factor, overlap
) -> None:
    net = cm.Network(intra, inter)
    slow = step(strategy, SHAPE, nodes, g, accum, fwd, bwd, net, overlap)
    fast = step(strategy, SHAPE, nodes, g, accum, fwd, bwd, net.scaled(factor), overlap)
    assert fast.total_s <= slow.total_s * (1 + 1e-9)
    assert fast.exposed_s <= slow.exposed_s * (1 + 1e-9) + 1e-12
