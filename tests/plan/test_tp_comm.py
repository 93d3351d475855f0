"""Tensor parallelism's cost model (llmctl.plan.comm.tp_calls / tp_step_comm, llmctl.plan.timing): the collectives it
counts per micro-batch against a hand count, their time against the nccl-tests formulas, async TP's overlap, the
compute split and FSDP beside TP."""

from __future__ import annotations

import pytest

from llmctl.plan import comm as cm
from llmctl.plan import flops as fl
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import compute_split, evaluate, tp_replicated_params
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from llmctl.spec.parallel import ParallelDims
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
L70B = resolve_model("llama-3.1-70b")
NET = cm.Network(intra_gbytes_s=360.0, inter_node_gbytes_s=None)  # one node: alpha 2 us inside it (the default)


def request(spec=L70B, **kw) -> PlanRequest:
    args = dict(spec=spec, gpu=H100, nodes=1, gpus_per_node=8, network=NET, seq_len=4096, global_batch_seqs=48)
    args.update(kw)
    return plan_request(**args)


def tp_ops(c) -> dict[str, tuple[int, float]]:
    """TP op name -> (calls per step, seconds per call)."""
    return {o.name: (o.calls_per_step, o.time_per_call_s) for o in c.predicted.comm_ops if o.phase == "tp"}


def hand_time(collective: str, n: int, size: float) -> float:
    """nccl-tests: busbw = algbw x (n-1)/n (all-gather, reduce-scatter) or 2(n-1)/n (all-reduce), so
    t = alpha x steps + S x factor / busbw; ring steps n-1, all-reduce min(2(n-1), 2 log2 n)."""
    factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}[collective]
    steps = {"all_gather": n - 1, "reduce_scatter": n - 1, "all_reduce": 6}[collective]  # 2 log2 8 = 6 < 14
    return cm.DEFAULT_ALPHA_INTRA_S * steps + size * factor / 360e9


def test_tp8_full_checkpointing_matches_a_hand_count() -> None:
    """Llama-3.1-70B (80 dense layers), TP 8, micro-batch 2 x 3 accumulation at 4k tokens, full checkpointing, no async
    TP. Per micro-batch, the activation A = 2 x 4096 x 8192 x 2 bytes moves in:
      all-gathers:     forward 2 per layer + LM head input; backward 2 per layer + the embedding's cut;
                       recompute 2 per layer                                   -> 6 x 80 + 2 = 482
      reduce-scatters: forward 2 per layer; backward 2 per layer + LM head; recompute 1 per layer (the attention's; the
                       MLP's makes the layer output, which checkpointing's early stop never regenerates) -> 5 x 80 + 1
      all-reduce:      the embedding's output, forward                        -> 1
    none hidden (no async TP), all inside the node."""
    req = request()
    setup = req.candidate(
        micro_batch_size=2, grad_accum_steps=3, checkpointing="full", attention="flash", compile=True, tp=8
    )
    c = evaluate(req, setup)
    A = 2 * 4096 * 8192 * 2
    ag, rs, ar = hand_time("all_gather", 8, A), hand_time("reduce_scatter", 8, A), hand_time("all_reduce", 8, A)
    per_micro_batch = 482 * ag + 401 * rs + ar
    assert c.predicted.tp_comm_exposed_s == pytest.approx(3 * per_micro_batch, rel=1e-12)
    ops = tp_ops(c)
    assert sum(n * t for n, t in ops.values()) == pytest.approx(3 * per_micro_batch, rel=1e-12)
    assert ops["TP all-gather (forward)"][0] == 3 * 161 and ops["TP all-gather (backward)"][0] == 3 * 161
    assert ops["TP all-gather (recompute)"][0] == 3 * 160 and ops["TP reduce-scatter (recompute)"][0] == 3 * 80
    assert ops["TP reduce-scatter (forward)"][0] == 3 * 160 and ops["TP reduce-scatter (backward)"][0] == 3 * 161
    assert ops["TP all-reduce (forward)"] == (3, pytest.approx(ar))
    # ~0.3 s per micro-batch: 884 calls of ~0.34 ms (134 MB x 7/8 at 360 GB/s)
    assert 0.28 < per_micro_batch < 0.32


@pytest.mark.parametrize(("ckpt", "recomputed"), [("none", 0), ("partial:4", 20), ("selective", 80), ("full", 80)])
def test_recompute_collectives_follow_the_checkpointing_mode(ckpt: str, recomputed: int) -> None:
    req = request()
    ops = tp_ops(
        evaluate(
            req,
            req.candidate(checkpointing=ckpt, attention="flash", tp=4),
        )
    )
    assert ops.get("TP all-gather (recompute)", (0, 0))[0] == 2 * recomputed
    assert ops.get("TP reduce-scatter (recompute)", (0, 0))[0] == recomputed
    assert ops["TP all-gather (backward)"][0] == 2 * 80 + 1 and ops["TP reduce-scatter (backward)"][0] == 2 * 80 + 1


def test_moe_and_sandwich_norm_layers() -> None:
    """A replicated MoE block: forward AG, RS, AG (its output cut locally), backward AG (the cut), AG, RS; Gemma's
    post-feed-forward norm reads the MLP's reduce-scatter, so the recompute re-runs it."""
    moe = cm.tp_calls([cm.TpLayer(count=10, recomputed=10, dense_mlp=False)])
    count = {}
    for c in moe:
        count[(c.collective, c.phase)] = count.get((c.collective, c.phase), 0) + c.calls
    assert count == {
        ("all_reduce", "forward"): 1,
        ("all_gather", "forward"): 2 * 10 + 1,
        ("reduce_scatter", "forward"): 10,
        ("all_gather", "backward"): 2 * 10 + 1,
        ("reduce_scatter", "backward"): 10 + 1,
        ("all_gather", "recompute"): 20,
        ("reduce_scatter", "recompute"): 10,
    }
    gemma = cm.tp_calls([cm.TpLayer(count=4, recomputed=4, norm_after_mlp=True)])
    assert sum(c.calls for c in gemma if c.phase == "recompute" and c.collective == "reduce_scatter") == 8


def test_async_tp_hides_each_collective_behind_its_matmul() -> None:
    """exposed = max(comm / tp, comm - matmul) per call: a call with a long matmul is hidden but for one chunk of
    tp (the pipeline's fill or drain), one without a matmul stays exposed."""
    layer = cm.TpLayer(count=1, qkv_s=1.0, o_s=0.0, gate_up_s=1.0, down_s=0.0)
    calls = cm.tp_calls([layer], head_s=1.0)
    A = 1e8
    sync = cm.tp_step_comm(calls, 8, A, 2, NET, 8, async_tp=False)
    hidden = cm.tp_step_comm(calls, 8, A, 2, NET, 8, async_tp=True)
    t = {c: hand_time(c, 8, A) for c in ("all_gather", "reduce_scatter", "all_reduce")}
    assert sync.exposed_s == pytest.approx(sync.total_s)
    # exposed with async: the calls paired with o (0 s) and down (0 s), the embedding's two, per micro-batch x 2
    # forward RS(o), RS(down); backward AG(o), AG(down); embedding AR + its backward AG
    exposed = 2 * (2 * t["reduce_scatter"] + 2 * t["all_gather"] + t["all_reduce"] + t["all_gather"])
    # the others (paired with q/k/v, gate/up and the head: 1 s, far longer than their transfer): one chunk in 8
    paired = [c for c in calls if c.matmul_s > 0]
    assert paired
    exposed += 2 * sum(c.calls * t[c.collective] / 8 for c in paired)
    assert hidden.exposed_s == pytest.approx(exposed)
    assert hidden.total_s == pytest.approx(sync.total_s)


def test_async_tp_is_priced_in_the_setup() -> None:
    req = request()
    plain = evaluate(
        req,
        req.candidate(
            micro_batch_size=2, grad_accum_steps=3, checkpointing="full", attention="flash", compile=True, tp=8
        ),
    )
    fused = evaluate(
        req,
        req.candidate(
            micro_batch_size=2,
            grad_accum_steps=3,
            checkpointing="full",
            attention="flash",
            compile=True,
            tp=8,
            async_tp=True,
        ),
    )
    assert fused.predicted.comm_total_s == pytest.approx(plain.predicted.comm_total_s)
    assert 0 <= fused.predicted.tp_comm_exposed_s < 0.5 * plain.predicted.tp_comm_exposed_s
    assert fused.predicted.tokens_per_s > plain.predicted.tokens_per_s


def test_each_rank_runs_a_tp_th_of_the_split_flops_and_all_of_the_moe() -> None:
    req = request()
    s1 = req.candidate(micro_batch_size=2, attention="flash")
    s8 = req.candidate(micro_batch_size=2, attention="flash", tp=8)
    e1, p1 = compute_split(req, s1)
    e8, p8 = compute_split(req, s8)
    width = req.efficiency.tp_width_factor(L70B, 8, req.gpu, 2 * 4096)
    assert 0.8 < width < 1 and e8 == pytest.approx(e1 * width)  # narrower matmuls run slower
    assert p8.matmul_fwd_s * e8 == pytest.approx(p1.matmul_fwd_s * e1 / 8)
    assert p8.matmul_bwd_s * e8 == pytest.approx(p1.matmul_bwd_s * e1 / 8)
    assert p8.attention_fwd_s == pytest.approx(p1.attention_fwd_s / 8)  # the heads split over the ranks
    moe = resolve_model("mixtral-8x7b")
    rep, _ = fl.tp_replicated_flops_per_token(moe, 4096)
    assert 0.5 < rep / fl.model_flops_per_token(moe, 4096) < 1  # the experts: most of Mixtral's FLOPs
    assert fl.tp_replicated_flops_per_token(L70B, 4096, "full") == (0, 0)


def test_fsdp_beside_tp_gathers_a_tp_th_of_each_layer_and_shares_the_nics() -> None:
    """With TP 4 on 8-GPU nodes, 4 shard groups (one per tp rank) each have 2 ranks on every node: they share its
    400 GB/s, and each all-gathers 1/4 of the split parameters (norms whole)."""
    replicated = tp_replicated_params(L70B)
    assert replicated == 8192 * (2 * 80 + 1)  # two RMSNorms per layer and the final one
    shape = cm.CommShape(params=L70B.params, num_layers=80, tp=4, tp_replicated_params=replicated)
    net = cm.Network(intra_gbytes_s=360.0, inter_node_gbytes_s=400.0, alpha_intra_s=0, alpha_inter_s=0)
    dims = ParallelDims.from_strategy("full_shard", 4, 8, tp=4)
    c = cm.step_comm(dims, shape, 8, 1, 0, 0, net)
    ag = next(o for o in c.ops if o.name.startswith("all-gather (forward"))
    assert ag.bytes_per_call == pytest.approx(((L70B.params - replicated) / 4 + replicated) / 80 * 2)
    assert ag.scope == "cross" and ag.busbw_gbytes_s == pytest.approx(100.0) and ag.n_ranks == 8
    one = cm.step_comm(ParallelDims.from_strategy("full_shard", 4, 8), cm.CommShape(L70B.params, 80), 8, 1, 0, 0, net)
    assert next(o for o in one.ops if o.name.startswith("all-gather (forward")).busbw_gbytes_s == pytest.approx(360.0)
