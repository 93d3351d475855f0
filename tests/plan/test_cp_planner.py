"""The planner with context parallelism: Llama-3.1-8B at 32k, 128k and 1M tokens on 8 and 64 H100s (one node, and 8
nodes with 8 x 400 Gbit/s each), what it picks and why, and the search's invariants and refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.errors import DoesNotFitError, InputError
from llmctl.plan import comm as cm
from llmctl.plan import memory as mem
from llmctl.plan import planner as pl
from llmctl.plan.emit import to_plan
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import evaluate
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
L8B = resolve_model("llama-3.1-8b")
K32, K128, M1 = 32768, 131072, 1048576


def request(nodes: int, seq_len: int, **kw) -> PlanRequest:
    """`llmctl plan llama-3.1-8b --gpu H100 --nodes N --gpus-per-node 8 [--inter-gbps 3200] --seq-len L`."""
    net = cm.Network(H100.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, 3200 / 8 if nodes > 1 else None)
    kw.setdefault("pp", 1)  # CP's search (PP's: tests/plan/test_pp_planner.py)
    return plan_request(spec=L8B, gpu=H100, nodes=nodes, gpus_per_node=8, network=net, seq_len=seq_len, **kw)


def consistent(r: pl.PlanResult) -> None:
    req = r.request
    for c in r.variants:
        s = c.setup
        assert s.dp * s.tp * s.cp == s.gpus and s.dims.fsdp_shard == s.dims.dp_shard * s.cp
        assert s.micro_batch_size * s.grad_accum_steps * s.dp == req.global_batch
        assert s.seq_len % (2 * s.cp * s.tp) == 0
        assert s.cp == 1 or s.attention == "sdpa"
        assert c.predicted.memory_per_gpu_bytes <= req.capacity_bytes
        p = c.predicted
        assert 0 <= p.cp_comm_exposed_s <= p.comm_exposed_s * (1 + 1e-12) <= p.comm_total_s * (1 + 1e-9)
        assert (c.predicted.cp_comm_exposed_s > 0) == (s.cp > 1)


# --- what it picks -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes", [1, 8])
def test_1m_tokens_only_fit_split_over_context_parallel_ranks(nodes: int) -> None:
    if nodes == 1:
        # 8 GPUs hold 131,072 tokens each at most with cp 8: the checkpointed block inputs alone are 32 GiB, the
        # recomputed block 24.5 GiB, the ring 13 GiB: nothing fits; the error names the fewest GPUs that do.
        with pytest.raises(
            DoesNotFitError, match=r"smallest cluster of H100-SXM that fits is 2 nodes x 8 \(16 GPUs\) with cp 16, "
        ):
            pl.plan(request(1, M1, pp=None))  # not pinned: the fewest-GPU answer searches what the planner does
        return
    r = pl.plan(request(nodes, M1))
    consistent(r)
    s = r.chosen.setup
    assert s.cp >= 16 and (s.loss_chunk_tokens > 0 or s.tp > 1)  # long context: the loss chunked, or on vocab shards
    assert "no setup without CP fits" in r.cp_choice and f"CP {s.cp}: at 1,048,576 tokens" in r.cp_choice
    with pytest.raises(DoesNotFitError, match="no setup satisfies --cp 1"):
        pl.plan(request(nodes, M1, cp=1))


@pytest.mark.parametrize("nodes", [1, 8])
def test_128k_tokens_pick_cp_where_nothing_without_it_and_tp_fits(nodes: int) -> None:
    r = pl.plan(request(nodes, K128))
    consistent(r)
    s = r.chosen.setup
    assert s.cp > 1
    assert f"CP {s.cp}: at 131,072 tokens the activations of one sequence need" in r.cp_choice
    # (CPU offload pinned off: on one node, offload's tp 1 beats TP 8 without CP; tests/plan/test_offload.py)
    without = pl.plan(request(nodes, K128, cp=1, offload=False))
    if nodes == 1:
        # On one node nothing fits without CP or TP: full checkpointing keeps 32 GiB of block inputs, recomputes a
        # 24.5 GiB block, next to 15 GiB of states sharded 8 ways (CPU offload, which takes the states to the host,
        # is pinned off; tests/plan/test_offload.py).
        with pytest.raises(DoesNotFitError):
            pl.plan(request(nodes, K128, cp=1, tp=1, offload=False))
        assert without.chosen.setup.tp > 1  # TP 8 with full checkpointing fits
    else:
        # On 64 GPUs the states shard 64 ways and full checkpointing fits without either.
        assert pl.plan(request(nodes, K128, cp=1, tp=1)).chosen.setup.checkpointing == "full"
    # What fits without CP predicts fewer tokens/s (more recompute, or TP's collectives): the explanation says so.
    assert without.chosen.predicted.tokens_per_s < r.chosen.predicted.tokens_per_s
    assert "the best without CP" in r.cp_choice and "fewer tokens/s" in r.cp_choice


@pytest.mark.parametrize("nodes", [1, 8])
def test_32k_tokens_fit_without_cp_and_it_says_how_cp_compares(nodes: int) -> None:
    """32k tokens fit without CP (with recompute); CP 2 may still win by sparing the recompute of attention, which
    runs at the kernel's measured rate (a third of the matmuls' on H100): either way the explanation compares."""
    r = pl.plan(request(nodes, K32))
    consistent(r)
    assert any(c.setup.cp > 1 for c in r.variants) and any(c.setup.cp == 1 for c in r.variants)
    if r.chosen.setup.cp == 1:
        assert r.cp_choice.startswith("CP ") and "lost" in r.cp_choice and "fits without it" in r.cp_choice
    else:
        assert "the best without CP" in r.cp_choice and "fewer tokens/s" in r.cp_choice


def test_the_plan_file_records_cp_and_the_chunked_loss() -> None:
    r = pl.plan(request(1, K128))
    plan = to_plan(r)
    assert plan is not None
    assert plan.parallel.cp == r.chosen.setup.cp > 1 and plan.parallel.cp_rotate == r.chosen.setup.cp_rotate
    assert plan.training.loss_chunk_tokens > 0 and plan.setup.cp == r.chosen.setup.cp
    assert "-cp" in plan.name
    assert r.as_dict(8)["chosen"]["cp"] == r.chosen.setup.cp and r.as_dict(8)["cp_choice"] == r.cp_choice


# --- the search --------------------------------------------------------------------------------------------------------
def test_pins_are_honoured_and_the_rotation_is_searched() -> None:
    r = pl.plan(request(1, K128, cp=4))
    assert {c.setup.cp for c in r.variants} == {4}
    assert "(--cp pinned)" in r.cp_choice
    r = pl.plan(request(1, K128, cp=1, tp=8))
    assert {c.setup.cp for c in r.variants} == {1} and r.cp_choice == "context parallelism: pinned off (--cp 1)"
    # Either rotation may win; each candidate's is the better of the two where both fit (ties: the all-gather).
    for c in pl.plan(request(8, K128)).variants:
        if c.setup.cp > 1:
            other = replace(c.setup, cp_rotate="allgather" if c.setup.cp_rotate == "alltoall" else "alltoall")
            req = request(8, K128)
            fits = mem.estimate(L8B, replace(other, grad_accum_steps=1, compile=False, async_tp=False)).device_bytes
            if fits <= req.capacity_bytes:
                assert evaluate(req, other).predicted.step_time_s >= c.predicted.step_time_s * (1 - 1e-12)


def test_long_sequences_keep_the_chunked_loss_unless_tp() -> None:
    r = pl.plan(request(1, 65536))
    assert all(c.setup.loss_chunk_tokens > 0 for c in r.variants if c.setup.tp == 1)
    assert all(c.setup.loss_chunk_tokens == 0 for c in r.variants if c.setup.tp > 1)
    assert any("the loss stays chunked" in line for line in r.rejected)
    short = pl.plan(request(1, 8192, cp=1))  # up to 32k both are tried
    assert {c.setup.loss_chunk_tokens for c in short.variants if c.setup.tp == 1} >= {0}
    pinned = pl.plan(request(1, 65536, loss_chunk_tokens=0, tp=1))
    assert all(c.setup.loss_chunk_tokens == 0 for c in pinned.variants)


def test_models_ring_attention_cannot_split_are_not_searched_and_refused_when_pinned() -> None:
    mistral = resolve_model("gemma-2-9b")  # soft-capped scores: no SDPA kernel, no ring
    req = plan_request(spec=mistral, gpu=H100, nodes=1, gpus_per_node=8, network=request(1, 8).network, seq_len=4096)
    r = pl.plan(req)
    assert {c.setup.cp for c in r.variants} == {1}
    assert r.cp_choice.startswith("context parallelism: not considered: gemma2 cannot use context parallelism")
    with pytest.raises(InputError, match="--cp 2: gemma2 cannot use context parallelism"):
        req.with_pins(cp=2)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"cp": 3}, "--cp 3 does not divide the 8 GPUs"),
        ({"cp": 4, "tp": 4}, "--cp 4 x --tp 4 does not divide the 8 GPUs"),
        ({"cp": 0}, "--cp must be a positive integer, got 0"),
        ({"cp": 2, "attention": "flash"}, "context parallelism runs ring attention on SDPA"),
        ({"cp": 8, "seq_len": 1000}, "seq len 1000 is not divisible by 16 (16 chunks for cp 8"),
    ],
)
def test_bad_pins_are_one_line(kw: dict, message: str) -> None:
    args = {"seq_len": K32, **kw}
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        request(1, **args)


def test_the_search_stays_fast_on_a_large_cluster() -> None:
    import time

    req = request(512, K128)
    pl.plan(req)  # warm the per-spec caches, as a second call in the same process would
    start = time.process_time()
    r = pl.plan(req)
    assert time.process_time() - start < 3.0  # about 0.5 s on a laptop core; loose for a loaded CI machine
    assert r.chosen.setup.cp > 1


def test_tune_prices_a_cp_plan_on_ring_attention() -> None:
    """`llmctl tune PLAN.yaml` on a cp plan whose kernel is `auto`: its pool keeps cp and prices SDPA (ring
    attention's kernel), not flash."""
    from llmctl.tune import space as tune_space

    plan = to_plan(pl.plan(request(1, K128)))
    assert plan is not None
    plan = plan.with_setup(replace(plan.setup, attention="auto"))
    req = tune_space.request_for_plan(plan, L8B, H100)
    assert req.pin("attention") == "sdpa"
    pool = tune_space.make_pool(req, tune_space.space_for(plan.setup, L8B, compile_=True), H100.name)
    assert pool.ranked and all(
        c.setup.cp == plan.parallel.cp and c.predicted.cp_comm_exposed_s > 0 for c in pool.ranked
    )
