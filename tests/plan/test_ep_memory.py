"""Expert parallelism's model states (llmctl.plan.memory.experts): the routed experts' bytes per GPU derived by hand for
Qwen3-30B-A3B (48 layers, 128 experts of width 768, hidden 2048) at ep 1, ep 8 and ep 8 x efsdp 2; the dense part
unchanged by ep; estimate-memory --ep's answer (the experts' line, the layout, the fewest GPUs, the model's refusals)."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.plan import memory as mem
from llmctl.plan.memory import experts as ex
from llmctl.plan.memory.estimate import PP_UNSHARDED_GRADS, PP_UNSHARDED_PARAMS
from llmctl.spec import models
from llmctl.spec.setup import TrainSetup

L, E, I, H = 48, 128, 768, 2048  # noqa: E741 (the field's names: layers, experts, width, hidden)
EXPERT = 3 * H * I  # gate_up (2I x H) + down (H x I) of one expert
EXPERTS = L * E * EXPERT  # 28,991,029,248 routed-expert parameters
STATE_BYTES = 4 + 4 + 8  # FSDP2 mixed AdamW: fp32 master, fp32 gradient, two fp32 moments
CB = 2  # bf16 compute copies


@pytest.fixture(scope="module")
def qwen():
    return models.resolve_model("qwen3-30b-a3b", None)


def setup_at(gpus: int, ep: int, **kw) -> TrainSetup:
    nodes, gpn = (1, gpus) if gpus <= 8 else (gpus // 8, 8)
    return TrainSetup(nodes=nodes, gpus_per_node=gpn, ep=ep, **kw)


def test_shape_by_hand(qwen):
    assert (qwen.num_layers, qwen.hidden_size) == (L, H)
    assert ex.held_expert_params(qwen, setup_at(8, 1)) == EXPERTS == 28_991_029_248


@pytest.mark.parametrize(
    ("gpus", "ep", "efsdp"),
    [(8, 1, 8), (8, 8, 1), (16, 8, 2)],
)
def test_expert_states_and_copies_by_hand(qwen, gpus, ep, efsdp):
    """States at rest: 16 bytes per parameter over ep x efsdp ranks (ExpertShare.param_fraction). Unsharded at the
    peak: two gathered layers of E/ep experts in bf16 less the rank's own 1/efsdp (whole when efsdp is 1), and one
    layer's E/ep experts' gradients for the reduce-scatter (bf16 + their fp32 upcast)."""
    s = setup_at(gpus, ep)
    assert (s.dims.ep, s.dims.expert_shard) == (ep, efsdp)
    m = ex.expert_memory(qwen, s)
    assert (m.local_experts, m.experts) == (E // ep, E)
    assert m.states_bytes == EXPERTS * STATE_BYTES // (ep * efsdp)
    local_layer = E // ep * EXPERT
    kept = (1 - 1 / efsdp) if efsdp > 1 else 1.0
    assert m.unsharded_bytes == int(2 * local_layer * CB * kept + local_layer * (CB + 4))


def test_ep8_on_8_gpus_numbers(qwen):
    """The brief's numbers: on 8 GPUs the experts' states are 54 GiB per GPU at both ep (FSDP already splits them 8
    ways); ep 8 saves the unsharded copies (E/8 experts per layer in flight instead of E)."""
    one, eight = ex.expert_memory(qwen, setup_at(8, 1)), ex.expert_memory(qwen, setup_at(8, 8))
    assert one.states_bytes == eight.states_bytes == EXPERTS * 2  # 16 bytes / 8 ranks
    assert eight.unsharded_bytes < one.unsharded_bytes / 7


def test_dense_part_unchanged_by_ep(qwen):
    """Every component but the experts' part of FSDP's gathered layers and reduce-scatter gradients (and the
    dispatch's own lines) is the same at ep 8 as at ep 1; those two differ by exactly the experts' (E - E/ep) x one
    expert."""
    one, eight = mem.estimate(qwen, setup_at(8, 1)), mem.estimate(qwen, setup_at(8, 8))
    a, b = one.per_component(), eight.per_component()
    moved = {"unsharded layers (FSDP all-gather)", "unsharded layer gradients (reduce-scatter)"}
    moved |= {ex.EP_SAVED, ex.EP_BUFFERS}
    assert {k: v for k, v in a.items() if k not in moved | {"allocator headroom"}} == {
        k: v for k, v in b.items() if k not in moved | {"allocator headroom"}
    }
    dense_layer = max(qwen.params_of(la) for la, _ in qwen.layer_groups) - E * EXPERT
    gathered = "unsharded layers (FSDP all-gather)"
    assert b[gathered] == int(2 * (dense_layer * (1 - 1 / 8) + E // 8 * EXPERT) * CB)
    grads = "unsharded layer gradients (reduce-scatter)"
    assert a[grads] - b[grads] == pytest.approx((E - E // 8) * EXPERT * (CB + 4), abs=1)


def test_pipeline_rank_keeps_local_experts_whole(qwen):
    """Under pp 2 (24 blocks a rank) at ep 4 on 8 GPUs (dp_shard 4, efsdp 1): the rank's parameters whole in bf16
    and their gradients whole in fp32 until the schedule's reduce-scatter, the experts at E/4."""
    s = setup_at(8, 4, pp=2)
    one = replace(s, ep=1)
    for e1, e4 in zip(mem.pipeline_rank_estimates(qwen, one), mem.pipeline_rank_estimates(qwen, s)):
        c1 = {c.name: c.bytes for c in e1.components}
        c4 = {c.name: c.bytes for c in e4.components}
        saved = 24 * (E - E // 4) * EXPERT
        assert c1[PP_UNSHARDED_PARAMS] - c4[PP_UNSHARDED_PARAMS] == pytest.approx(saved * CB, abs=1)
        assert c1[PP_UNSHARDED_GRADS] - c4[PP_UNSHARDED_GRADS] == pytest.approx(saved * 4, abs=1)
    assert ex.expert_memory(qwen, s).unsharded_bytes == 24 * E // 4 * EXPERT * (CB + 4)


def test_zero_engine_unsharded_lines_keep_local_experts(qwen):
    """The zero engine at ZeRO-1: the half weights and gradients no stage shards hold the rank's E/ep experts whole;
    the master weights and moments (sharded from stage 1) split over dp x ep as FSDP's do."""
    s = setup_at(8, 4, engine="zero", strategy="zero1")
    assert ex.expert_fraction(s, 1) == 1 / 4
    assert ex.expert_fraction(s, 8) == 1 / 8
    m = ex.expert_memory(qwen, s)
    # master fp32 (4) + Adam (8) over 8 ranks; half weights (2) + fp32 gradients (4) on E/4 experts
    assert m.states_bytes == pytest.approx(EXPERTS * (12 / 8 + 6 / 4), rel=1e-12)
    est = {c.name: c.bytes for c in mem.estimate(qwen, s).components}
    dense = qwen.params - EXPERTS
    assert est["bf16 weights"] == pytest.approx(2 * (dense + EXPERTS / 4), abs=1)


def run(*argv: str):
    return CliRunner().invoke(app, ["estimate-memory", *argv])


def test_cli_ep8_on_8_h100():
    """The brief's case failed on a 1-GPU setup inside the fewest-GPUs search; now it answers, names ep and shows the
    experts' line."""
    r = run("qwen3-30b-a3b", "--gpu", "H100", "--gpus", "8", "--ep", "8")
    assert r.exit_code == 0, r.output
    assert "over 8 GPUs, ep=8" in r.output
    assert "routed experts at ep 8: 16 of 128 per rank" in r.output
    js = json.loads(run("qwen3-30b-a3b", "--gpu", "H100", "--gpus", "8", "--ep", "8", "--json").output)
    assert js["experts"]["states_bytes"] == EXPERTS * 2
    # GPU counts where ep 8 divides no dp_shard x cp are skipped, not failed
    assert "ep 8 divides the dp_shard x cp of no node count" in js["min_gpus_by_strategy"]["no_shard"]["note"]
    assert js["min_gpus_by_strategy"]["full_shard"]["gpus"] % 8 == 0


def test_cli_model_refuses_ep_first():
    r = run("llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--ep", "2")
    assert r.exit_code == 2
    assert "expert parallelism (ep 2) needs a mixture-of-experts model; llama-3.1-8b is dense" in r.output
    r = run("llama-3.1-8b", "--ep", "2")  # one GPU: the model's reason, not the ranks'
    assert r.exit_code == 2 and "is dense" in r.output
    r = run("qwen3-30b-a3b", "--gpus", "6", "--ep", "3")
    assert r.exit_code == 2 and "ep 3 does not divide qwen3-30b-a3b's 128 routed experts" in r.output


def test_dispatch_activations_by_hand(qwen):
    """At ep 8, micro-batch 1 x 2048 tokens, top-8, balanced (IMBALANCE 1.0: a rank receives as many rows as it
    sends, 16,384): what llmctl.engine.experts.dispatch_forward keeps per MoE layer (send side: two int64 indices,
    the combined row and its bf16 routing weight; receive side: two int64 indices, the row, gate_up's 2I, act's I,
    the product's I; the offsets of 16 local experts) over what the ep 1 loop keeps (the gathered row and the down
    output, 4I, an fp32 weight, three int64 indices); and one layer's all-to-all buffers (sent and received rows)."""
    t, k = 2048, 8
    rows = t * k
    ep_layer = rows * (CB * H + CB + 16) + rows * (CB * (H + 4 * I) + 16) + 4 * (E // 8)
    loop_layer = rows * (CB * (2 * H + 4 * I) + 4 + 24)
    est = {c.name: c for c in mem.estimate(qwen, setup_at(8, 8, seq_len=2048)).components}
    assert est[ex.EP_SAVED].bytes == L * (ep_layer - loop_layer)
    assert est[ex.EP_SAVED].note == "dropless, balanced routing assumed (imbalance 1.0)"
    assert est[ex.EP_BUFFERS].bytes == CB * H * (rows + rows)
    assert "loss_backward" not in est[ex.EP_BUFFERS].phases
    # ep 1: none of these lines (the goldens hold the rest bit for bit)
    names = {c.name for c in mem.estimate(qwen, setup_at(8, 1, seq_len=2048)).components}
    assert not names & {ex.EP_SAVED, ex.EP_BUFFERS}


def test_checkpointing_keeps_no_dispatch_but_recomputes_one(qwen):
    s = setup_at(8, 8, seq_len=2048, checkpointing="full")
    est = {c.name: c.bytes for c in mem.estimate(qwen, s).components}
    assert ex.EP_SAVED not in est
    layer = qwen.layers[0]
    assert est["recomputed block (backward): ep dispatch"] == ex.saved_delta_bytes(qwen, s, layer, 2048)
    half = {c.name: c.bytes for c in mem.estimate(qwen, replace(s, checkpointing="partial:2")).components}
    assert half[ex.EP_SAVED] == L // 2 * ex.saved_delta_bytes(qwen, s, layer, 2048)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"])
@pytest.mark.parametrize("ab", [2, 4])
def test_loop_bytes_are_the_activations_term(preset, ab):
    """What the dispatch's lines subtract is exactly the ep 1 estimate's own line for the experts' rows, so the ep > 1
    estimate holds the dispatch's bytes and nothing of the loop's."""
    spec = models.resolve_model(preset, None)
    layer = next(la for la in spec.layers if la.mlp.moe)
    terms = mem.layer_activation_terms(spec, 1, 512, ab, "sdpa", layer)
    assert terms["moe dispatched tokens"] == ex.loop_saved_bytes(spec, layer, 512, ab)
