"""The step's compute by kind of kernel (torch-free): matmuls at their shape's rate, attention at its kernel's measured
rate, memory-bound ops (norms, activations, rotary, residual adds, the loss, LoRA's adapter arithmetic) as bytes over
HBM bandwidth, and the framework's own traffic (FSDP2's copies into and out of its collective buffers, the optimizer
step). The rates come from llmctl.spec.kernels (presets/kernels.yaml, each table with its source); llmctl.plan.timing
adds them up with the FLOP bookkeeping of each parallelism and precision.

Bytes per element below are counted from the ops Hugging Face's modules run (transformers' LlamaRMSNorm upcasts to
fp32 and runs five kernels; apply_rotary_pos_emb four products and sums; the loss upcasts the logits), each op reading
its inputs and writing its output once. torch.compile fuses a block's elementwise chains into one read and one write
(the `_COMPILED` counts). A backward moves twice its forward's bytes (reads the saved input and the incoming gradient,
writes the input's gradient): a stated assumption, not a count.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.plan import experts as ex
from llmctl.plan import flops as fl
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import kernels as kt
from llmctl.spec.attention import Attention
from llmctl.spec.finetune import adapted_linears, targets_for
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import TrainSetup

ROW_WISE = ("o_proj", "down_proj", "attn.c_proj", "mlp.c_proj", "c_proj")
"""Projections tensor parallelism splits by rows (their reduction width K / tp); the others lose output columns."""
# Bytes per element, forward, eager (Hugging Face's modules) and compiled (one fused read and write).
NORM_EAGER, NORM_COMPILED = 36, 4  # RMSNorm: to fp32 (2+4), pow (8), mean (4), x rsqrt (8), to bf16 (6), x weight (4)
LAYERNORM = 4  # F.layer_norm is one kernel
ADD_EAGER, ADD_COMPILED = 6, 4  # a residual add reads two and writes one; compiled, fused into the next norm
ROPE_EAGER, ROPE_COMPILED = 18, 4  # rotate_half (neg, cat: 8), x cos (4), x sin (4), sum (6): per q/k element
SWIGLU_EAGER, SWIGLU_COMPILED = 10, 6  # silu (4), x up (6); fused: read gate and up, write
GELU_EAGER, GELU_COMPILED = 20, 4  # GPT-2's NewGELU: five elementwise ops
LAYOUT_COPY = 4  # SDPA's output transposed back and made contiguous (Hugging Face's sdpa path), per output element
MOE_PERMUTE = 8  # per hidden element of each routed copy: the gather to the experts and the weighted combine back
LOSS_FWD = LOSS_BWD = 14  # per logit: upcast to fp32 (6), log-softmax (8); backward the same passes
EMBED_FWD = 4  # the embedding lookup reads and writes a row
# FSDP2 copies the gathered buffer into the parameters: per parameter and compute byte, per all-gather.
FSDP_COPY_OUT = 2
# AdamW per trainable parameter a step: the gradient read twice (norm, step) 8, fp32 master read and written 8, m and v
# read and written 16.
OPTIMIZER_FP32_BYTES = 32
# LoRA per adapted linear, per element of its input (in) and output (out) width: forward, A reads x (2 per in), B
# writes (2), the scaling reads and writes (4), the add reads two and writes (6): 12 per out; backward, the scaling's
# and B's (8 per out), A's input gradient written and added to the base's (8 per in).
ADAPTER_FWD_IN, ADAPTER_FWD_OUT, ADAPTER_BWD_IN, ADAPTER_BWD_OUT = 2, 12, 8, 8
# Compiled, the scale and the add fuse into one kernel (read B's output and the base's, write): 6 per out; backward
# alike, 4 per in and per out.
ADAPTER_COMPILED = (2, 6, 4, 4)


@dataclass(frozen=True)
class MemoryTime:
    """Seconds of one micro-batch's memory-bound work on one rank."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    """The forward's memory-bound ops of the blocks whole-block checkpointing re-runs (in backward)."""
    framework_s: float
    """FSDP2's copies around its collectives."""


def _bw(gpu: GPUSpec) -> float:
    return gpu.hbm_gbytes_s * 1e9 * kt.memory_bound_efficiency()


def gemm_efficiency(gpu: GPUSpec, spec: ModelSpec, tokens: int, tp: int, peak_tflops: float, ep: int = 1) -> float:
    """The FLOP-weighted fraction of `peak_tflops` the model's matmuls reach for a micro-batch of `tokens` rows per
    rank: each block projection forward (tokens x in x out), its input gradient (tokens x out x in) and weight gradient
    (in x tokens x out), and the LM head, at llmctl.spec.kernels.gemm_seconds. Under tensor parallelism the row-wise
    projections reduce over in / tp and the others produce out / tp; a mixture-of-experts block's experts each see
    tokens x k / experts rows (transformers' expert loop; replicated under TP). Under expert parallelism (ep > 1)
    each MoE layer's experts run as the EP path's two grouped GEMMs over the rows the rank received, each priced as
    one GEMM of that total shape (llmctl.plan.experts.grouped_gemms, whose docstring says what is assumed)."""
    key = ("gemm_eff", gpu.name, gpu.architecture, tokens, tp, peak_tflops) + ((ex.IMBALANCE,) if ep > 1 else ())
    return fl._memo(spec, key, lambda: _gemm_efficiency(gpu, spec, tokens, tp, peak_tflops, ep))


def _gemm_efficiency(gpu: GPUSpec, spec: ModelSpec, tokens: int, tp: int, peak: float, ep: int = 1) -> float:
    flops = secs = 0.0

    def add(m: float, k: float, n: float, count: float) -> None:
        nonlocal flops, secs
        for mm, kk, nn in ((m, k, n), (m, n, k), (k, m, n)):  # forward, input gradient, weight gradient
            flops += count * 2 * mm * kk * nn
            secs += count * kt.gemm_seconds(gpu, mm, kk, nn, peak)

    for layer, count in spec.layer_groups:
        mlp = layer.mlp
        if ep > 1 and mlp.moe and spec.measured is None:
            for rows, i, o in ex.grouped_gemms(layer, spec.hidden_size, tokens, ex.IMBALANCE):
                add(rows, i, o, count)
        for name, i, o in fl.layer_matmuls(spec, layer):
            m = float(tokens)
            if name.startswith("expert") and ep > 1 and spec.measured is None:
                continue  # the grouped GEMMs above
            if name.startswith("expert"):
                m = tokens * mlp.experts_per_token / max(1, mlp.num_experts)
                add(m, i, o, count / max(1, mlp.experts_per_token) * mlp.num_experts)
                continue
            if tp > 1 and not (mlp.moe and not name.startswith(("q", "k", "v", "o", "kv", "qkv"))):
                i, o = (i / tp, o) if name.endswith(ROW_WISE) else (i, o / tp)
            add(m, i, o, count)
    add(tokens, spec.hidden_size, spec.vocab_size / tp, 1)
    return flops / (secs * peak * 1e12) if secs else 1.0


def _attn_layer(layer: Layer, seq_len: int, ring_ranks: int) -> tuple[float, float, float]:
    """(FLOPs per query token forward, FlashAttention convention; the kernel call's length, this rank's part of the
    sequence; head dim for the table)."""
    at = layer.attention
    span = at.span(seq_len)
    length = min(seq_len / ring_ranks, at.window) if at.window else seq_len / ring_ranks
    return at.num_heads * span * (at.head_dim + at.v_head_dim), length, (at.head_dim + at.v_head_dim) / 2


def attention_seconds(
    req_gpu: GPUSpec,
    spec: ModelSpec,
    setup: TrainSetup,
    seq_len: int,
    dtype: str,
    imbalance: float = 1.0,
    checkpointing: str | None = None,
) -> tuple[float, float, float]:
    """(forward, backward, recomputed forward) seconds of one micro-batch's attention scores and values on one rank:
    its heads (num_heads / tp) of its queries (micro-batch x seq / cp), `imbalance` the slowest cp rank's share
    (llmctl.spec.parallel.ParallelDims.attention_imbalance). Fused kernels at the kernel table's rate; eager
    attention as the score matrix's passes through memory. Recompute: the whole-checkpointed blocks' forward again, and under selective
    eager attention's (a fused kernel's output is kept); `checkpointing` overrides the setup's. Every term is linear
    in the queries: the per-query seconds are cached per model, GPU and shape (the planner asks thousands of times)."""
    ckpt = checkpointing or setup.checkpointing
    kernel = kt.kernel_for(setup.attention, req_gpu)
    peak = req_gpu.peak_tflops(dtype)
    key = ("attention", req_gpu.name, req_gpu.architecture, req_gpu.hbm_gbytes_s, peak, dtype, kernel)
    shard = setup.dims.rank_shard(seq_len)
    key += (seq_len, shard.ring_ranks, shard.tensor_ranks, ckpt, imbalance)
    f, b, r = fl._memo(
        spec, key, lambda: _attention_per_query(req_gpu, spec, kernel, peak, dtype, seq_len, setup, ckpt, imbalance)
    )
    queries = setup.micro_batch_size * seq_len / shard.ring_ranks
    return queries * f, queries * b, queries * r


def _attention_per_query(
    req_gpu: GPUSpec,
    spec: ModelSpec,
    kernel: str,
    peak: float,
    dtype: str,
    seq_len: int,
    setup: TrainSetup,
    ckpt: str,
    imbalance: float,
) -> tuple[float, float, float]:
    shard = setup.dims.rank_shard(seq_len)
    tp = shard.tensor_ranks
    if spec.measured is not None:  # no per-layer layout: the spec's heads and width, full attention
        layers: list[tuple[Layer | None, int]] = [(None, spec.num_layers)]
    else:
        layers = list(spec.layer_groups)
    redo_share: dict[Layer | None, int] = {}  # blocks whose attention forward runs again, per kind of block
    if ckpt == "selective":
        redo_share = {la: (n if setup.attention.keeps_scores else 0) for la, n in layers}
    elif ckpt != "none":
        for i in ckpt_modes.whole_layers(ckpt, spec.num_layers):
            la = spec.layers[i] if spec.measured is None else None
            redo_share[la] = redo_share.get(la, 0) + 1
    fwd = bwd = redo = 0.0
    for layer, n in layers:
        if layer is None:
            per_q = 2 * spec.num_heads * seq_len * spec.head_dim
            length, dim, heads, span = seq_len / shard.ring_ranks, spec.head_dim, spec.num_heads, seq_len
        else:
            per_q, length, dim = _attn_layer(layer, seq_len, shard.ring_ranks)
            heads, span = layer.attention.num_heads, seq_len
        if setup.attention.keeps_scores:
            f, b = kt.eager_seconds(req_gpu, heads / tp, 1.0, span, dim, peak)
        else:
            rf, rb, _ = kt.attention_rate(req_gpu, kernel, dim, length, dtype)
            work = per_q / tp * imbalance
            f, b = work / (rf * 1e12), kt.FA_BACKWARD_FLOPS * work / (rb * 1e12)
        fwd, bwd, redo = fwd + n * f, bwd + n * b, redo + redo_share.get(layer, 0) * f
    return fwd, bwd, redo


def _layer_bytes(spec: ModelSpec, layer: Layer, setup: TrainSetup) -> float:
    """Forward memory-bound bytes per token of one block on one rank (module docstring), in the compute dtype's
    element size relative to 2 bytes."""
    h, at, mlp = spec.hidden_size, layer.attention, layer.mlp
    c = setup.compile
    norm = LAYERNORM if layer.norm_bias else (NORM_COMPILED if c else NORM_EAGER)
    total = len(layer.norms) * norm * h + 2 * (ADD_COMPILED if c else ADD_EAGER) * h
    if spec.features.rotary:
        qk = at.num_heads * at.head_dim + at.num_kv_heads * at.head_dim
        total += (ROPE_COMPILED if c else ROPE_EAGER) * qk
        if at.qk_norm != "none":
            total += (NORM_COMPILED if c else NORM_EAGER) * qk
    if setup.attention is Attention.SDPA:
        total += LAYOUT_COPY * at.num_heads * at.v_head_dim
    if mlp.moe:
        total += MOE_PERMUTE * h * mlp.experts_per_token
        width = mlp.intermediate_size * mlp.experts_per_token + (mlp.shared_size or 0)
    else:
        width = mlp.intermediate_size
    if mlp.act == "gelu":
        total += (GELU_COMPILED if c else GELU_EAGER) * width
    else:
        total += (SWIGLU_COMPILED if c else SWIGLU_EAGER) * width
    return total * setup.compute_bytes / 2 / setup.tp


def _adapter_bytes(spec: ModelSpec, setup: TrainSetup, index: int) -> tuple[float, float]:
    ft = setup.finetune
    if not ft.adapters:
        return 0.0, 0.0
    lin = adapted_linears(spec, targets_for(spec, ft), index)
    i, o = sum(fi for _, fi, _ in lin), sum(fo for _, _, fo in lin)
    drop = 5 * i if ft.dropout else 0  # dropout reads and writes the input, and writes its mask
    fi, fo, bi, bo = (
        ADAPTER_COMPILED if setup.compile else (ADAPTER_FWD_IN, ADAPTER_FWD_OUT, ADAPTER_BWD_IN, ADAPTER_BWD_OUT)
    )
    return fi * i + fo * o + drop, bi * i + bo * o + drop


def memory_bytes_per_token(
    spec: ModelSpec, setup: TrainSetup, checkpointing: str | None = None
) -> tuple[float, float, float]:
    """(forward, backward, recomputed forward) memory-bound bytes per token on one rank; `checkpointing` overrides
    the setup's."""
    ckpt = checkpointing or setup.checkpointing
    key = ("membytes", setup.compile, setup.attention, setup.compute_bytes, setup.tp, setup.finetune, ckpt)
    return fl._memo(spec, key, lambda: _memory_bytes(spec, setup, ckpt))


def _memory_bytes(spec: ModelSpec, setup: TrainSetup, ckpt: str) -> tuple[float, float, float]:
    h = spec.hidden_size
    per_layer: list[float] = []
    adapters_f = adapters_b = 0.0
    if spec.measured is not None:
        proxy = Layer(attention=spec.layers[0].attention, mlp=spec.layers[0].mlp) if spec.layers else None
        per_layer = [_layer_bytes(spec, proxy, setup) if proxy else 0.0] * spec.num_layers
    else:
        firsts: dict[Layer, tuple[float, float, float]] = {}
        for i, layer in enumerate(spec.layers):
            if layer not in firsts:
                firsts[layer] = (_layer_bytes(spec, layer, setup), *_adapter_bytes(spec, setup, i))
            block, af, ab = firsts[layer]
            per_layer.append(block)
            adapters_f, adapters_b = adapters_f + af, adapters_b + ab
    final = (LAYERNORM if spec.layer_norms else (NORM_COMPILED if setup.compile else NORM_EAGER)) * h
    fwd = sum(per_layer) + final + EMBED_FWD * h + LOSS_FWD * spec.vocab_size / setup.tp
    bwd = 2 * (sum(per_layer) + final + EMBED_FWD * h) + LOSS_BWD * spec.vocab_size / setup.tp
    b = setup.compute_bytes / 2
    fwd, bwd = fwd + adapters_f * b, bwd + adapters_b * b
    if ckpt in ("none", "selective"):
        again = 0.0
    else:
        again = sum(per_layer[i] for i in ckpt_modes.whole_layers(ckpt, spec.num_layers))
    return fwd, bwd, again


def memory_time(
    gpu: GPUSpec,
    spec: ModelSpec,
    setup: TrainSetup,
    tokens: int,
    calibration: float = 1.0,
    checkpointing: str | None = None,
) -> MemoryTime:
    """One micro-batch's memory-bound seconds on one rank (`tokens`: its tokens), FSDP2's copies included; a
    calibration (--calibrate) scales the bandwidth as it scales every compute rate; `checkpointing` overrides the
    setup's."""
    bw = _bw(gpu) * calibration
    if bw <= 0:
        return MemoryTime(0.0, 0.0, 0.0, 0.0)
    f, b, again = memory_bytes_per_token(spec, setup, checkpointing)
    return MemoryTime(tokens * f / bw, tokens * b / bw, tokens * again / bw, fsdp_copy_bytes(spec, setup) / bw)


def fsdp_copy_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """Bytes per micro-batch FSDP2 moves on one rank around its collectives (the engine shards every strategy with
    FSDP2, no_shard over shard groups of one), as an H100 profile of the engine shows them (split/3b-2k in
    docs/measurements/h100-gpu-tier.json): per all-gather, its shard cast to the compute dtype (read the fp32
    master, write the compute copy) and the gathered buffer copied out into the parameters (FSDP_COPY_OUT x compute
    bytes; on a shard group of one the gather itself is such a copy); two gathers a micro-batch when parameters are
    resharded after forward, one under shard_grad_op. Per reduce-scatter, the unsharded gradients copied into its
    input (read in the compute dtype, written in the reduce dtype), and from the second micro-batch of a step on,
    the reduced shard added to the accumulated one (read both, write: 3 x reduce bytes). Frozen weights are gathered
    but get no gradient (LoRA: the adapters' only). Under pp: once a schedule run (below)."""
    if setup.engine != "fsdp2" or not setup.fsdp_wraps:
        return 0.0  # one rank without FSDP2 (llmctl.spec.setup.fsdp_wraps): no collective, no copies around one
    params = spec.params / setup.tp
    shard = setup.dims.fsdp_shard
    gathers = 1 if setup.strategy == "shard_grad_op" else 2
    cb, rb = setup.compute_bytes, setup.precision.reduce_bytes
    master = setup.precision.param_bytes
    one = FSDP_COPY_OUT * cb if shard == 1 else 0  # a group of one: the all-gather is a device copy too
    # Under expert parallelism a rank gathers (and holds unsharded gradients of) its E/ep local experts only, over
    # the efsdp group (llmctl.plan.experts); the shards it casts stay 1/shard of everything.
    unsharded = params - _remote_experts(spec, setup)
    per_gather = (master + cb) * params / shard + (FSDP_COPY_OUT * cb + one) * params
    if setup.ep > 1:  # ep divides shard (> 1): `one` is 0; a group of one for the local experts copies them too
        local = 0.0 if setup.dims.expert_shard > 1 else ex.expert_params_memo(spec) / setup.ep
        per_gather = (master + cb) * params / shard + FSDP_COPY_OUT * cb * (unsharded + local)
    trained = fl.adapter_count(spec, setup.finetune) / setup.tp if setup.finetune.adapters else unsharded
    if setup.pp > 1:
        # A pipeline stage is gathered once a schedule run and kept, its unsharded gradients accumulated in place and
        # reduce-scattered at the run's last backward (llmctl.plan.comm.step_comm, pipelined): one gather's and one
        # reduction's copies a run, over its micro-batches (the whole model's: timing scales them to the stage's).
        return (per_gather + trained * (cb + rb)) / setup.pipeline_microbatches
    acc = setup.grad_accum_steps
    accumulate = 3 * rb * trained / shard * (acc - 1) / acc
    return gathers * per_gather + trained * (cb + rb) + accumulate


def _remote_experts(spec: ModelSpec, setup: TrainSetup) -> float:
    """Routed-expert parameters a rank neither gathers nor gets unsharded gradients of: the (ep - 1)/ep held by the
    other ranks of its ep group (0 at ep 1)."""
    if setup.ep <= 1:
        return 0.0
    return ex.expert_params_memo(spec) * (setup.ep - 1) / setup.ep


def optimizer_seconds(gpu: GPUSpec, spec: ModelSpec, setup: TrainSetup) -> float:
    """One optimizer step on one rank: AdamW streams its share of the trainable parameters' states, master weights
    and gradients through HBM (OPTIMIZER_FP32_BYTES a parameter with fp32 moments; bf16 moments 8 fewer, 8-bit 12
    fewer). None under CPU offload (the host steps: llmctl.plan.offload)."""
    bw = _bw(gpu)
    if bw <= 0 or setup.levers.offload:
        return 0.0
    trained = fl.adapter_count(spec, setup.finetune) if setup.finetune.adapters else spec.params
    per = OPTIMIZER_FP32_BYTES - {"bf16": 8, "8bit": 12}.get(setup.states_dtype, 0)
    return trained / (setup.tp * setup.dims.shard_degree(1)) * per / bw
