"""float8 training in the cost and memory models (llmctl.plan.float8): which linears convert, the split of the FLOPs
between the fp8 and the bf16 peak, the cast traffic, the float8 all-gather and the memory lines. The numbers are
derived by hand from Llama-3.1-8B's shapes (hidden 4096, 8 kv heads of 128, MLP 14336, 32 layers, vocabulary
128256)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan import float8 as f8
from llmctl.plan import flops as fl
from llmctl.plan import memory as mem
from llmctl.plan import planner as pl
from llmctl.plan.request import HBM_EFFICIENCY, PlanRequest
from llmctl.plan.timing import compute_split, evaluate, float8_cast_s, float8_saving
from llmctl.spec import kernels as kt
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import from_hf_config, preset_entry, resolve_model
from llmctl.spec.precision import policy
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
L8B = resolve_model("llama-3.1-8b")
NET = cm.Network(H100.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, None)
# One Llama-3.1-8B block's linears, in features x out features: q, k, v, o, gate, up, down.
LINEARS = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
BLOCK_IO = sum(i * o for i, o in LINEARS)  # 218,103,808


def request(precision: str = "fp8", spec=L8B, gpu=H100, **kw) -> PlanRequest:
    args = dict(spec=spec, gpu=gpu, nodes=1, gpus_per_node=8, network=NET, seq_len=2048, precision=precision, tp=1)
    args.update(kw)
    return plan_request(**args)


def with_config(**fields) -> object:
    return from_hf_config({**preset_entry("llama-3.1-8b")["config"], **fields}, name="llama-variant")


def test_every_block_linear_converts_and_the_lm_head_does_not() -> None:
    assert f8.converted(L8B) == [True] * 7
    assert BLOCK_IO == 218_103_808
    model, replicated = f8.linear_flops_per_token(L8B)
    assert model == 6 * 32 * BLOCK_IO == 41_875_931_136 and replicated == 0
    # The rest runs in bf16: the LM head (6 x 4096 x 128256) and the attention scores and values (12 L a d s); 6N
    # also counts the norms' weights (two per block and the final one).
    lm_head, attention, norms = 6 * 4096 * 128256, 12 * 32 * 32 * 128 * 2048, 6 * 4096 * (2 * 32 + 1)
    assert fl.model_flops_per_token(L8B, 2048) == model + lm_head + attention + norms
    assert model / fl.model_flops_per_token(L8B, 2048) == pytest.approx(0.8679, abs=1e-4)
    assert f8.linear_params(L8B) == (32 * BLOCK_IO, 0) and f8.linear_count(L8B) == 224
    assert f8.summary(L8B, 2048, policy("fp8"))["kept_in_compute_dtype"] == ["lm_head"]


def test_a_linear_not_a_multiple_of_16_stays_in_bf16() -> None:
    """An MLP width of 14344 (a multiple of 8, not of 16): gate and up (out 14344) and down (in 14344) stay in bf16,
    the attention's projections convert. Catches a filter that checks one dimension only (gate/up's in features are
    4096), or either-or, or a multiple of 8."""
    odd = with_config(intermediate_size=14344)
    assert f8.converted(odd) == [True, True, True, True, False, False, False]
    assert f8.linear_flops_per_token(odd)[0] == 6 * 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)


def test_routers_routed_experts_and_conv1d_stay_in_bf16() -> None:
    """Mixtral: the router (a gate of 8 outputs) and the routed experts (3-D parameters, not nn.Linear) stay in bf16;
    GPT-2's Conv1D projections are not nn.Linear (nothing converts)."""
    mixtral = resolve_model("mixtral-8x7b")
    names = [name for name, _, _ in fl.layer_matmuls(mixtral)]
    kept = {name for name, c in zip(names, f8.converted(mixtral)) if not c}
    assert kept == {"router", "expert gate_up", "expert down"}
    assert f8.converted(resolve_model("gpt2-xl")) == [False] * 4
    with pytest.raises(InputError, match="gpt2-xl has no linear layer float8 converts"):  # as the engine refuses it
        pl.plan(request(spec=resolve_model("gpt2-xl"), seq_len=1024))
    # Qwen3-MoE's router has 128 outputs, a multiple of 16: it stays in bf16 by name, not by its shape.
    qwen = resolve_model("qwen3-30b-a3b")
    router = [c for (name, _, _), c in zip(fl.layer_matmuls(qwen), f8.converted(qwen)) if name == "router"]
    assert router == [False] and qwen.layers[0].mlp.num_experts == 128


def test_a_tp_rank_casts_its_share_and_the_replicated_moe_blocks_whole() -> None:
    """Under tensor parallelism a tensorwise rank casts 1/tp of the split linears (torchao's float8 TP styles cast on
    the shard) and all of an MoE block's shared expert; a rowwise rank (torch's styles) casts the all-gathered input
    of a column-wise linear and the all-gathered output gradient of a row-wise one (o, down) whole."""
    t, tw, rw = 4096, policy("fp8"), policy("fp8-rowwise")
    one = f8.cast_bytes(L8B, tw, t, "none", compiled=True)
    assert f8.cast_bytes(L8B, tw, t, "none", compiled=True, tp=2) == (one[0] / 2, one[1] / 2)
    col_in, row_in = 5 * 4096, 4096 + 14336  # q, k, v, gate, up read the hidden state; o and down are row-split
    col_out, row_out = 4096 + 2 * 1024 + 2 * 14336, 2 * 4096
    fwd = 3 * 32 * (t * (col_in + row_in / 2) + BLOCK_IO / 2)  # compiled: 2 + 1 bytes an element
    bwd = fwd + 3 * 32 * 2 * t * (col_out / 2 + row_out)
    assert f8.cast_bytes(L8B, rw, t, "none", compiled=True, tp=2) == (fwd, bwd)
    assert f8.cast_bytes(L8B, rw, t, "none", compiled=True) == f8.cast_bytes(L8B, tw, t, "none", compiled=True)
    # the largest float8 copies at tp 2 are down_proj's either way: its input and weight shards (+ scales)
    assert f8.transient_bytes(L8B, tw, t, tp=2)[0] == (t * 14336 + 14336 * 4096) / 2 + 2 * 4
    assert f8.transient_bytes(L8B, rw, t, tp=2)[0] == (t * 14336 + 14336 * 4096) / 2 + 4 * (t + 4096)
    ds = resolve_model("deepseek-v3")
    total, replicated = f8.linear_params(ds)
    shared = 3 * 7168 * 2048  # one shared expert of 2048 (n_shared_experts 1 x moe_intermediate_size 2048)
    assert replicated == 58 * shared and total > replicated  # 58 MoE blocks of 61; attention and dense MLPs split


def test_the_converted_linears_run_at_the_fp8_peak_and_the_rest_at_bf16() -> None:
    """Forward seconds less the casts = tokens x (model FLOPs - half the converted linears' FLOPs) / 3 / (bf16 peak x
    efficiency): the converted FLOPs at H100's 1979 TFLOP/s, the LM head and attention at 989.5."""
    req, bf = request(), request("bf16-mixed")
    setup = req.candidate(micro_batch_size=2, attention="flash")
    eff, sp = compute_split(req, setup)
    eff_bf, sp_bf = compute_split(bf, replace(setup, precision=bf.precision))
    assert eff == eff_bf and float8_saving(req, setup) == 0.5
    # attention leaves the matmul count (the kernel table times it, the same under both precisions)
    tokens = 2 * 2048
    model = fl.model_flops_per_token(L8B, 2048) - fl.attention_flops_per_token(L8B, 2048)
    cast_f, cast_b = float8_cast_s(req, setup, tokens)
    rate = H100.peak_tflops("bf16") * 1e12 * eff
    assert sp.matmul_fwd_s == pytest.approx(tokens * (model - 0.5 * 6 * 32 * BLOCK_IO) / 3 / rate, rel=1e-12)
    assert sp.matmul_bwd_s == pytest.approx(2 * sp.matmul_fwd_s, rel=1e-12)
    assert sp_bf.matmul_fwd_s == pytest.approx(tokens * model / 3 / rate, rel=1e-12)
    assert sp.attention_fwd_s == sp_bf.attention_fwd_s and sp.memory_fwd_s == pytest.approx(sp_bf.memory_fwd_s + cast_f)
    assert sp.memory_bwd_s == pytest.approx(sp_bf.memory_bwd_s + cast_b)


def test_the_recomputed_forward_runs_its_linears_at_the_fp8_peak_too() -> None:
    assert f8.recompute_linear_flops_per_token(L8B, "full") == (2 * 32 * BLOCK_IO, 0)
    assert f8.recompute_linear_flops_per_token(L8B, "partial:4") == (2 * 8 * BLOCK_IO, 0)
    # selective re-runs every other matmul: k_proj, o_proj and up_proj (llmctl.plan.flops.selective_kept)
    redo = 4096 * 1024 + 4096 * 4096 + 4096 * 14336
    assert f8.recompute_linear_flops_per_token(L8B, "selective") == (2 * 32 * redo, 0)
    assert f8.recompute_linear_flops_per_token(L8B, "none") == (0, 0)


def test_cast_bytes_are_derived_from_the_shapes() -> None:
    """Without an all-gather (one GPU) every cast is the linear's own: forward its input (T x in) and weight (in x
    out), backward grad_output twice, the weight and the input; each element read for the amax, read and written as
    one byte (2 x 2 + 1 for bf16), or read once and written under compile (2 + 1)."""
    t, sum_in = 4096, sum(i for i, _ in LINEARS)
    sum_out = sum(o for _, o in LINEARS)
    fwd, bwd = f8.cast_bytes(L8B, policy("fp8"), t, "none", compiled=False)
    assert fwd == 5 * 32 * (t * sum_in + BLOCK_IO)
    assert bwd == 5 * 32 * (t * (2 * sum_out + sum_in) + BLOCK_IO)
    assert f8.cast_bytes(L8B, policy("fp8"), t, "none", compiled=True)[0] == 3 * 32 * (t * sum_in + BLOCK_IO)
    # full checkpointing casts the forward's operands again in backward
    assert f8.cast_bytes(L8B, policy("fp8"), t, "full", compiled=False)[1] == bwd + fwd
    assert f8.cast_bytes(L8B, policy("bf16-mixed"), t, "full", compiled=False) == (0.0, 0.0)
    req = request(gpus_per_node=1)
    setup = req.candidate(micro_batch_size=2, attention="flash")
    assert float8_cast_s(req, setup, t) == pytest.approx(
        (fwd / (3350e9 * HBM_EFFICIENCY), bwd / (3350e9 * HBM_EFFICIENCY)), rel=1e-12
    )


def test_each_checkpointing_mode_recasts_only_the_linears_it_reruns() -> None:
    """The backward's recompute term, linear by linear: full re-casts every converted linear's forward operands
    (input and weight), partial:4 a quarter of the blocks, selective only the matmuls it does not keep (k, o, up:
    llmctl.plan.flops.selective_kept), none nothing. The forward's casts never change."""
    t, e = 4096, 5  # not compiled: 2 x 2 + 1 bytes an element
    none = f8.cast_bytes(L8B, policy("fp8"), t, "none", compiled=False)

    def recast(pick: list[int]) -> float:
        return e * sum(t * LINEARS[k][0] + LINEARS[k][0] * LINEARS[k][1] for k in pick)

    every = recast(list(range(7)))
    for mode, blocks, pick in (("full", 32, range(7)), ("partial:4", 8, range(7)), ("selective", 32, (1, 3, 5))):
        fwd, bwd = f8.cast_bytes(L8B, policy("fp8"), t, mode, compiled=False)
        assert fwd == none[0], mode
        assert bwd - none[1] == blocks * recast(list(pick)), mode
    assert recast([1, 3, 5]) < every  # selective re-casts 3 of the 7 linears


def test_under_the_float8_all_gather_the_weights_are_cast_on_the_shard() -> None:
    """Tensorwise over 8 shards: no weight cast in the linears, the fp32 shard cast before each all-gather (4 + 1
    bytes an element) and read once a step for the amax precompute; rowwise casts the gathered bf16 weights."""
    t, conv = 4096, 32 * BLOCK_IO
    sum_in = sum(i for i, _ in LINEARS)
    fwd, _ = f8.cast_bytes(L8B, policy("fp8"), t, "none", compiled=False, fsdp_shard=8, grad_accum=2)
    assert fwd == pytest.approx(5 * 32 * t * sum_in + 5 * conv / 8 + 4 * conv / 8 / 2)
    rowwise = f8.cast_bytes(L8B, policy("fp8-rowwise"), t, "none", compiled=False, fsdp_shard=8)
    assert rowwise == f8.cast_bytes(L8B, policy("fp8-rowwise"), t, "none", compiled=False)


def _gathers(precision: str, strategy: str = "full_shard") -> tuple[float, list[cm.CommOp]]:
    req = request(precision)
    c = evaluate(
        req,
        req.candidate(strategy=strategy, micro_batch_size=2, grad_accum_steps=8, attention="flash"),
    )
    ag = next(o for o in c.predicted.comm_ops if o.name == "all-gather (forward)") if strategy != "no_shard" else None
    return (ag.bytes_per_call if ag else 0.0), c.predicted.comm_ops


def test_tensorwise_halves_the_converted_weights_all_gather_rowwise_does_not() -> None:
    """FSDP2 all-gathers a layer's share of the parameters: 2 bytes each in bf16, 1 for the converted linears' under
    tensorwise (torchao's float8 all-gather), and one all-reduce of 224 fp32 amaxes a step."""
    per_layer, conv = L8B.params / 32, BLOCK_IO
    bf16, bf16_ops = _gathers("bf16-mixed")
    tensorwise, tw_ops = _gathers("fp8-tensorwise")
    rowwise, rw_ops = _gathers("fp8-rowwise")
    assert bf16 == pytest.approx(2 * per_layer) and rowwise == bf16
    assert tensorwise == pytest.approx(2 * per_layer - conv, rel=1e-9)
    amax = [o for o in tw_ops if "amax" in o.name]
    assert len(amax) == 1 and amax[0].bytes_per_call == 4 * 224 and amax[0].calls_per_step == 1
    assert not any("amax" in o.name for o in bf16_ops + rw_ops)
    assert not any("amax" in o.name for o in _gathers("fp8-tensorwise", "no_shard")[1])  # no FSDP shards


def test_the_memory_lines_of_float8() -> None:
    """micro-batch 2 x 2048 tokens on 8 H100 (full_shard): the unsharded layers hold the converted weights in float8
    under tensorwise; the transient copies are the largest linear's (forward: down_proj's input, backward: gate's two
    grad_outputs and its input) plus their fp32 scales; the activations are bf16-mixed's."""

    def comps(precision: str) -> dict[str, int]:
        req = request(precision)
        setup = req.candidate(micro_batch_size=2, attention="flash")
        return {c.name: c.bytes for c in mem.estimate(L8B, setup).components}

    bf16, tw, rw = comps("bf16-mixed"), comps("fp8"), comps("fp8-rowwise")
    block = L8B.params_per_layer
    assert bf16["unsharded layers (FSDP all-gather)"] == int(2 * block * 2 * 7 / 8)
    assert tw["unsharded layers (FSDP float8 all-gather)"] == int(2 * ((block - BLOCK_IO) * 2 + BLOCK_IO) * 7 / 8)
    assert rw["unsharded layers (FSDP all-gather)"] == bf16["unsharded layers (FSDP all-gather)"]
    t = 2 * 2048
    assert tw["float8 copies of one linear (forward)"] == t * 14336 + 2 * 4
    assert tw["float8 copies of one linear (backward)"] == t * (2 * 14336 + 4096) + 4 * 4
    # rowwise casts the weight in the linear (no float8 gather) and keeps a scale per row
    assert rw["float8 copies of one linear (forward)"] == t * 14336 + 14336 * 4096 + 4 * (t + 4096)
    assert rw["float8 copies of one linear (backward)"] == t * 32768 + 4096 * 14336 + 4 * (t + 14336 + 2 * 4096)
    for name in ("activations (saved for backward)", "loss log-softmax (fp32, b*s*V)", "final norm + LM-head input"):
        assert tw[name] == rw[name] == bf16[name]
    assert "float8 copies of one linear (forward)" not in bf16


def test_the_unsharded_float8_block_per_tp_rank() -> None:
    """One all-gathered block under the float8 all-gather, term by term: its converted weights at 1 byte a parameter
    and the rest (norms) in bf16, each split over the tp ranks (a dense model replicates nothing in a tp group)."""
    block = L8B.params_per_layer
    for tp in (1, 2, 4):
        converted_bytes = BLOCK_IO / tp
        other_bytes = 2 * (block - BLOCK_IO) / tp
        assert f8.unsharded_layer_bytes(L8B, 2, tp) == pytest.approx(converted_bytes + other_bytes, rel=1e-12), tp


def test_fp8_predicts_more_tokens_per_second_than_bf16_by_a_derived_margin() -> None:
    """The planner's best fp8-tensorwise setup of Llama-3.1-8B on 8 H100 against its best bf16-mixed one (tp 1, as
    the engine runs float8). The margin follows from the shapes and the catalog (87% of the FLOPs at twice the rate,
    the casts over HBM bandwidth, half the gathered bytes), not from a measurement. torchtitan's reported +28%
    tokens/s for Llama-3-8B on H100 with float8 (docs/sources.md#gpu-float8) is a sanity check only: the model prices
    fp8 GEMMs at the efficiency of bf16 ones, so it predicts a little more (+29%). It can never reach
    1 / (1 - 0.868 / 2), what halving the converted linears' time alone would give."""
    bf = pl.plan(request("bf16-mixed")).chosen.predicted
    fp8 = pl.plan(request("fp8")).chosen.predicted
    rowwise = pl.plan(request("fp8-rowwise")).chosen.predicted
    assert 1.2 < fp8.tokens_per_s / bf.tokens_per_s < 1 / (1 - 0.5 * 0.868)
    assert bf.tokens_per_s < rowwise.tokens_per_s < fp8.tokens_per_s  # rowwise gathers bf16, casts the weights
    # MFU stays against the bf16 peak (torchtitan's convention): the float8 run's MFU grows with its tokens/s.
    assert fp8.mfu / bf.mfu == pytest.approx(fp8.tokens_per_s / bf.tokens_per_s)


def test_fp16_mixed_runs_at_the_fp16_peak_on_a_v100() -> None:
    v100 = resolve_gpu("V100-16GB")
    gpt2 = resolve_model("gpt2-xl")
    req = plan_request(spec=gpt2, gpu=v100, nodes=1, gpus_per_node=4, network=NET, seq_len=1024)
    assert req.precision.name == "fp16-mixed" and "no bf16 tensor cores" in (req.precision_why or "")
    setup = req.candidate()
    eff, sp = compute_split(req, setup)
    mm = fl.model_flops_per_token(gpt2, 1024) - fl.attention_flops_per_token(gpt2, 1024)
    assert sp.matmul_fwd_s == pytest.approx(1024 * mm / 3 / (125e12 * eff), rel=1e-12)
    # SDPA on a V100 runs the memory-efficient kernel, timed at the fp16 peak's share
    assert kt.kernel_for("sdpa", v100) == "efficient" and sp.attention_fwd_s > 0
    result = pl.plan(req)
    assert result.precision_choice.startswith("fp16-mixed: V100-16GB has no bf16 tensor cores")
    assert result.as_dict(3)["precision"] == "fp16-mixed"
