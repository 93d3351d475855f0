"""The planner's tensor-parallel search: which degrees it tries, what it pins, what every TP candidate carries, and
how it explains the choice (llmctl.plan.planner, llmctl.plan.explain)."""

from __future__ import annotations

import pytest

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan import kernel_time, space
from llmctl.plan import planner as pl
from llmctl.plan.ranking import sort_key
from llmctl.plan.request import PlanRequest
from llmctl.plan.search import parallel_bound
from llmctl.plan.space import Choice
from llmctl.plan.timing import evaluate
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from tests.plan.requests import plan_request

A100 = resolve_gpu("A100-80GB")
H100 = resolve_gpu("H100-SXM")
SEED_NET = cm.Network(A100.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, 50 / 8)
IB_NET = cm.Network(H100.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, 3200 / 8)


def seed(**kw) -> PlanRequest:
    args = dict(
        spec=resolve_model("llama-2-7b"),
        gpu=A100,
        nodes=2,
        gpus_per_node=4,
        network=SEED_NET,
        seq_len=1024,
        global_batch_seqs=128,
        cp=1,  # TP's search on the seed (CP's: tests/plan/test_cp_planner.py)
        pp=1,  # and PP's: tests/plan/test_pp_planner.py
    )
    args.update(kw)
    return plan_request(**args)


def h100_70b(**kw) -> PlanRequest:
    args = dict(
        spec=resolve_model("llama-3.1-70b"), gpu=H100, nodes=32, gpus_per_node=8, network=IB_NET, seq_len=8192, pp=1
    )
    args.update(kw)
    return plan_request(**args)


def test_tp_off_leaves_the_data_parallel_plan_as_it_was() -> None:
    """--tp 1 searches exactly what the planner searched before TP: the seed's answer (HYBRID over 2 nodes, selective,
    flash) and every candidate without TP."""
    r = pl.plan(seed(tp=1))
    s = r.chosen.setup
    assert (s.strategy, s.nodes, s.tp, s.checkpointing, s.attention) == ("hybrid_shard", 2, 1, "selective", "flash")
    assert all(c.setup.tp == 1 and not c.setup.async_tp for c in r.variants)
    assert r.tp_choice == "tensor parallelism: pinned off (--tp 1)"


def test_every_candidate_is_consistent_and_tp_shares_the_micro_batch() -> None:
    req = seed()
    r = pl.plan(req)
    tps = {c.setup.tp for c in r.variants}
    assert tps == {1, 2, 4}
    for c in r.variants:
        s = c.setup
        assert s.micro_batch_size * s.grad_accum_steps * s.dp == req.global_batch  # per data-parallel rank
        assert s.dims.tp == s.tp and s.dp * s.tp == s.gpus
        if s.tp > 1:
            assert s.loss_chunk_tokens == 0  # loss parallel instead
            assert not s.async_tp  # A100 (NVLink3): async TP is not priced before Hopper
        else:
            assert not s.async_tp
    assert any(c.setup.tp > 1 for c in r.candidates)  # the table lists TP families too


def test_seed_with_tp_explains_the_choice_with_numbers() -> None:
    r = pl.plan(seed())
    c = r.chosen
    assert c.setup.tp > 1  # on 50 Gbps, TP cuts what FSDP moves between the nodes per micro-batch
    text = r.tp_choice
    assert text.startswith(f"TP {c.setup.tp} frees ")  # A100: async TP not priced
    assert "GiB of activations per GPU at micro-batch" in text and "% of the step on NVLink3 (" in text
    assert "the best without TP (HYBRID_SHARD over 2 nodes" in text and "fewer tokens/s" in text


@pytest.mark.parametrize("model", ["gpt2-xl", "phi-4"])
def test_never_tp_for_a_family_without_a_plan(model: str) -> None:
    spec = resolve_model(model)
    req = plan_request(
        spec=spec, gpu=H100, nodes=1, gpus_per_node=8, network=IB_NET, seq_len=1024, global_batch_seqs=64
    )
    assert space.tp_degrees(req, []) == [1]
    with pytest.raises(InputError, match="cannot use tensor parallelism"):
        plan_request(spec=spec, gpu=H100, nodes=1, gpus_per_node=8, network=IB_NET, tp=2)


@pytest.mark.parametrize("model", ["deepseek-v3", "gpt-oss-20b", "olmo-2-7b"])
def test_the_families_planned_for_issue_45_are_searched_and_pinned_at_tp(model: str) -> None:
    """MLA (DeepSeek-V3), attention sinks (gpt-oss) and q/k norms over all heads (OLMo 2) have a tensor-parallel plan
    now: the search covers tp 1, 2, 4 and 8 in a node of 8, and --tp 2 is taken."""
    spec = resolve_model(model)
    req = plan_request(
        spec=spec, gpu=H100, nodes=1, gpus_per_node=8, network=IB_NET, seq_len=1024, global_batch_seqs=64
    )
    assert space.tp_degrees(req, []) == [1, 2, 4, 8]
    assert plan_request(spec=spec, gpu=H100, nodes=1, gpus_per_node=8, network=IB_NET, tp=2).pins["tp"] == 2


def test_gpt2_plan_never_proposes_tp_and_says_why() -> None:
    spec = resolve_model("gpt2-xl")
    r = pl.plan(plan_request(spec=spec, gpu=A100, nodes=1, gpus_per_node=4, network=SEED_NET, seq_len=1024))
    assert {c.setup.tp for c in r.variants} == {1}
    assert r.tp_choice.startswith("tensor parallelism: not considered: gpt2 cannot use tensor parallelism")


def test_never_a_degree_that_does_not_divide_the_kv_heads() -> None:
    """SmolLM3-3B: 16 heads but 4 kv heads: TP 8 would split a kv head."""
    spec = resolve_model("smollm3-3b")
    req = plan_request(
        spec=spec, gpu=H100, nodes=1, gpus_per_node=8, network=IB_NET, seq_len=4096, global_batch_seqs=64
    )
    r = pl.plan(req)
    assert {c.setup.tp for c in r.variants} <= {1, 2, 4} and 8 not in space.tp_degrees(req, [])
    with pytest.raises(InputError, match="tp 8 does not divide smollm3's num_key_value_heads 4"):
        req.with_pins(tp=8)


def test_a_pinned_tp_is_honoured_or_refused_in_one_line() -> None:
    r = pl.plan(seed(tp=2))
    assert {c.setup.tp for c in r.variants} == {2} and r.chosen.setup.tp == 2
    with pytest.raises(InputError, match="--tp 3 does not divide the 4 GPUs per node"):
        seed(tp=3)
    with pytest.raises(InputError, match="--tp 8 does not divide the 4 GPUs per node"):
        seed(tp=8)
    with pytest.raises(InputError, match="loss parallel"):
        seed(tp=2, loss_chunk_tokens=512)
    pinned_chunk = pl.plan(seed(loss_chunk_tokens=2048))
    assert {c.setup.tp for c in pinned_chunk.variants} == {1}
    assert any("TP computes the loss unchunked" in line for line in pinned_chunk.rejected)


def test_async_tp_only_with_compile_on_hopper_class_nvlink() -> None:
    r = pl.plan(seed(compile=False))
    assert not any(c.setup.async_tp for c in r.variants)
    for name, priced in (("MI300X", False), ("A100-80GB", False), ("H100-PCIe", False), ("H100-SXM", True)):
        gpu = resolve_gpu(name)
        req = seed(gpu=gpu, network=cm.Network(gpu.link_gbytes_s * 0.8, 50 / 8), compile=True)
        assert req.async_tp is priced, name
        got = {c.setup.async_tp for c in pl.plan(req).variants if c.setup.tp > 1}
        assert got <= {priced} and (not priced or got == {True}), (name, got)


def test_70b_on_32_nodes_of_h100_lists_tp_candidates_and_explains() -> None:
    """torchtitan's published 70B run on 256 H100 used FSDP 32 x TP 8; the planner prices TP from its own model (no
    constant tuned to that run): TP must at least be among the candidates, beat the best setup without TP (which
    needs full checkpointing to fit micro-batch 1 at 8k tokens), and be explained."""
    r = pl.plan(h100_70b())
    c = r.chosen.setup
    assert c.tp > 1 and c.async_tp and c.dp * c.tp == 256
    assert {x.setup.tp for x in r.candidates[:8]} >= {1, c.tp}
    no_tp = next(x for x in r.variants if x.setup.tp == 1 and x.setup.cp == 1)
    assert no_tp.setup.checkpointing == "full" and no_tp.predicted.tokens_per_s < r.chosen.predicted.tokens_per_s
    assert r.tp_choice.startswith(f"TP {c.tp} (async) frees ")


def test_tp_families_that_cannot_win_are_skipped_by_their_compute_bound() -> None:
    """Large clusters: a TP family on few nodes cannot beat the best setup even without communication: it is not
    searched; its bound is the compute the full evaluation prices for the largest micro-batch, without recompute."""
    req = h100_70b(nodes=1024, seq_len=4096)
    r = pl.plan(req)
    assert any(line.startswith("TP ") and "even without communication" in line for line in r.rejected)
    bound = parallel_bound(req, Choice("full_shard", 64, 8, attention="flash", compile=True))
    per_rank = req.global_batch // 64  # 64 data-parallel ranks: one per node
    one = evaluate(
        req,
        req.candidate(nodes=64, micro_batch_size=per_rank, attention="flash", compile=True, tp=8, async_tp=True),
    )
    assert one.predicted.tokens_per_s < bound < -sort_key(req, r.chosen)[0]
    # the bound leaves out the optimizer step (a smaller step: a higher bound)
    optimizer = kernel_time.optimizer_seconds(req.gpu, req.spec, one.setup)
    assert one.predicted.compute_s - optimizer == pytest.approx(req.global_batch * 4096 / bound)


def test_tp_that_does_not_divide_the_sequence_is_never_proposed() -> None:
    spec = resolve_model("llama-3.1-8b")
    req = plan_request(
        spec=spec, gpu=H100, nodes=1, gpus_per_node=8, network=IB_NET, seq_len=4098, global_batch_seqs=64
    )
    rejected: list[str] = []
    assert space.tp_degrees(req, rejected) == [1, 2]  # 4098 = 2 x 2049
    assert any("seq len 4098 does not divide" in r for r in rejected)
    assert {c.setup.tp for c in pl.plan(req).variants} <= {1, 2}
