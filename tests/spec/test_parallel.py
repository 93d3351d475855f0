"""ParallelDims: degrees from a strategy, validation, and what is derived from them (hand-checked)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmctl.errors import InputError, UnknownNameError
from llmctl.spec.parallel import ParallelDims, canonical_strategy


@pytest.mark.parametrize(
    ("strategy", "nodes", "gpn", "dims"),
    [
        ("full_shard", 2, 4, (1, 8)),  # FULL = (1, W)
        ("hybrid_shard", 2, 4, (2, 4)),  # HYBRID = (nodes, gpus per node)
        ("no_shard", 2, 4, (8, 1)),  # NO_SHARD = (W, 1)
        ("FULL", 1, 8, (1, 8)),
        ("hsdp", 4, 8, (4, 8)),
        ("ddp", 1, 2, (2, 1)),
    ],
)
def test_strategy_to_degrees(strategy: str, nodes: int, gpn: int, dims: tuple[int, int]) -> None:
    d = ParallelDims.from_strategy(strategy, nodes, gpn)
    assert (d.dp_replicate, d.dp_shard) == dims and d.world_size == nodes * gpn
    assert d.strategy == canonical_strategy(strategy)


def test_tp_pp_split_the_world_and_hybrid_shards_inside_a_node() -> None:
    d = ParallelDims.from_strategy("hybrid_shard", nodes=4, gpus_per_node=8, tp=2, pp=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp) == (2, 2, 4, 2) and d.world_size == 32 and d.dp == 8
    with pytest.raises(InputError, match="tp=3 x pp=1"):
        ParallelDims.from_strategy("full_shard", 1, 8, tp=3)
    with pytest.raises(InputError, match="does not divide"):
        ParallelDims.from_strategy("hybrid_shard", 2, 8, shard_size=3)
    with pytest.raises(InputError, match="only meaningful with hybrid_shard"):
        ParallelDims.from_strategy("full_shard", 2, 8, shard_size=4)
    with pytest.raises(UnknownNameError, match="unknown strategy 'fully'"):
        ParallelDims.from_strategy("fully", 1, 8)
    with pytest.raises(InputError, match="dp_shard must be a positive integer"):
        ParallelDims(dp_shard=0)


def test_data_parallel_rank_skips_tensor_parallel_ranks() -> None:
    # tp innermost: ranks 0,1 are one tp group (same data), 2,3 the next; dp_shard 2, dp_replicate 2.
    d = ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert d.coords(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    # tokens per step count data-parallel ranks only: 2 x 4 accumulation x 1024 x dp 4
    assert d.tokens_per_step(2, 4, 1024) == 2 * 4 * 1024 * 4
    with pytest.raises(InputError, match="outside a world of 8"):
        d.dp_rank(8)


def test_mesh_and_collective_scopes() -> None:
    full = ParallelDims.from_strategy("full_shard", 2, 4)
    hybrid = ParallelDims.from_strategy("hybrid_shard", 2, 4)
    ddp = ParallelDims.from_strategy("no_shard", 2, 4)
    assert full.mesh_dims == ((8,), ("shard",))
    assert hybrid.mesh_dims == ((2, 4), ("replicate", "shard"))
    assert ddp.mesh_dims == ((8, 1), ("replicate", "shard"))
    assert full.group_scope("dp_shard", 4) == "cross"  # one ring over both nodes
    assert hybrid.group_scope("dp_shard", 4) == "intra"
    assert hybrid.group_scope("dp_replicate", 4) == "inter"  # one rank per node, 4 groups share the NICs
    assert ddp.group_scope("dp_replicate", 4) == "cross"
    assert ParallelDims.from_strategy("no_shard", 1, 8).group_scope("dp_replicate", 8) == "intra"
    # tp innermost (torchtitan's order): consecutive ranks form a tp group; FSDP2 gets every other dimension.
    assert ParallelDims(dp_shard=4, tp=2).mesh_dims == ((4, 2), ("shard", "tp"))
    hsdp_tp = ParallelDims.from_strategy("hybrid_shard", 2, 8, tp=2)
    assert hsdp_tp.mesh_dims == ((2, 4, 2), ("replicate", "shard", "tp"))
    assert hsdp_tp.dp_mesh_dims == ("replicate", "shard")
    assert [hsdp_tp.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # a tp group shares its micro-batch
    # cp between the data-parallel dims and tp; FSDP2 shards over shard x cp (torchtitan's dp_shard_cp).
    cp = ParallelDims.from_strategy("hybrid_shard", 2, 8, tp=2, cp=2)
    assert cp.mesh_dims == ((2, 2, 2, 2), ("replicate", "shard", "cp", "tp"))
    assert cp.dp_mesh_dims == ("replicate", "shard", "cp")
    assert cp.fsdp_shard == 4 and cp.shard_degree(3) == 4 and cp.shard_degree(1) == 4
    assert ParallelDims(dp_shard=2, cp=2).mesh_dims == ((2, 2), ("shard", "cp"))
    # pp outermost (torchtitan's (pp, dp_replicate, dp_shard, cp, tp)); FSDP2 never shards over it
    pp = ParallelDims(dp_replicate=2, dp_shard=2, pp=2)
    assert pp.mesh_dims == ((2, 2, 2), ("pp", "replicate", "shard")) and pp.dp_mesh_dims == ("replicate", "shard")
    assert [pp.coords(r)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # ep borrows from dp_shard x cp: the experts' mesh splits those ranks into (efsdp, ep), ep innermost, over the
    # same ranks as the main mesh (pp and replicate outside)
    ep = ParallelDims(dp_shard=4, ep=2)
    assert ep.mesh_dims == ((4,), ("shard",)) and ep.expert_shard == 2
    assert ep.expert_mesh_dims == ((2, 2), ("efsdp", "ep"))
    big = ParallelDims(dp_replicate=2, dp_shard=2, cp=4, pp=2, ep=4)
    assert big.expert_shard == 2 and big.expert_mesh_dims == ((2, 2, 2, 4), ("pp", "replicate", "efsdp", "ep"))
    assert ParallelDims(dp_shard=8, ep=8).expert_mesh_dims == ((1, 8), ("efsdp", "ep"))
    with pytest.raises(InputError, match="ep 3 must divide the ranks it borrows from: dp_shard 4 x cp 1 = 4"):
        ParallelDims(dp_shard=4, ep=3)


@given(
    strategy=st.sampled_from(["full_shard", "hybrid_shard", "no_shard", "shard_grad_op", "zero1"]),
    nodes=st.integers(1, 64),
    gpn=st.sampled_from([1, 2, 4, 8]),
)
def test_degrees_multiply_to_the_world_and_dp_ranks_cover_the_batch(strategy: str, nodes: int, gpn: int) -> None:
    d = ParallelDims.from_strategy(strategy, nodes, gpn)
    assert d.world_size == nodes * gpn == d.dp
    assert sorted(d.dp_rank(r) for r in range(d.world_size)) == list(range(d.dp))


def test_context_and_expert_slots() -> None:
    """cp is a factor of the world laid out between dp_shard and tp (torchtitan's mesh order); ep borrows from
    dp_shard x cp and stays 1 in the engine until its issue."""
    d = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, cp=2)
    assert d.world_size == 8 and d.dp == 2
    assert [d.coords(r)["cp"] for r in range(4)] == [0, 0, 1, 1]
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # a cp x tp group shares its micro-batch
    assert ParallelDims.from_strategy("full_shard", 2, 8, tp=2, cp=2).dp_shard == 4
    with pytest.raises(InputError, match="ep 3 must divide"):
        ParallelDims(dp_shard=4, ep=3)
    assert d.mesh_dims == ((2, 2, 2), ("shard", "cp", "tp"))
    # FSDP's group is shard x cp: 4 ranks at stride tp=2, inside one 8-GPU node, across two 4-GPU nodes.
    assert d.group_scope("dp_shard", 8) == "intra" and d.group_scope("dp_shard", 4) == "cross"
