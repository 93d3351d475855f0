"""Memory model: bytes per GPU for training a ModelSpec under a sharding strategy (torch-free, pure functions).

What it predicts: the peak of PyTorch's *allocated* bytes (torch.cuda.max_memory_allocated) per GPU, as the
largest of three phases (end of forward, backward, optimizer step), not a blind sum of components. On top of it,
the caching allocator's fragmentation headroom gives *reserved* bytes, and the CUDA context (+ NCCL buffers),
which lives outside the allocator, gives what nvidia-smi shows. A setup fits when that last figure is within the
device's memory.

Model states: a ledger of bytes per parameter for precision x optimizer (the classic mixed-precision AdamW budget
is 4 fp32 master + 2 half weights + 4 fp32 grads + 8 Adam = 18), each line sharded from the ZeRO stage that
shards it (Rajbhandari et al. 2020): optimizer states from stage 1, gradients from stage 2, parameters from
stage 3. Two engines keep different things:
- "fsdp2" (llmctl's engine, torch FSDP2): the sharded fp32 parameters ARE the master weights; no persistent half
  copy exists (bf16 copies exist only for the layers unsharded at the moment: the "unsharded layers" line).
  Persistent: 4 + 4 + 8 = 16 bytes/param for mixed AdamW, all sharded under FULL/HYBRID/SHARD_GRAD_OP.
- "zero" (DeepSpeed/Megatron style): a persistent half copy (sharded only at stage 3) next to the fp32 master.

Activations are derived tensor by tensor from what Hugging Face's Llama and GPT-2 blocks save for backward
(measured with torch.autograd.graph.saved_tensors_hooks; tests/plan/test_memory_measured.py re-measures them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from llmctl.errors import InputError, UnknownNameError
from llmctl.plan import flops as fl
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import precision as prec
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import ParallelDims, canonical_strategy
from llmctl.spec.precision import PRECISIONS
from llmctl.units import GIB

OPTIMIZERS = ("adamw", "adamw-8bit", "adafactor", "lion", "sgd", "none")
ENGINES = ("fsdp2", "zero")
ATTENTIONS = ("eager", "sdpa", "flash")
CHECKPOINTING = ckpt_modes.MODES
"""The parameter-free modes; `partial:K` is the fourth (llmctl.spec.checkpointing)."""

# CUDA context + cuBLAS/cuDNN workspaces + NCCL communicator buffers, outside the caching allocator.
# PyTorch >= 1.13 with lazy module loading uses ~0.5-0.9 GiB of context (0.9 GB measured on an A100,
# docs/sources.md#tune-up-seed); NCCL adds ~0.2-0.5 GiB per communicator. 1 GiB is the stated default.
DEFAULT_CUDA_CONTEXT_BYTES = 1 * GIB
# Caching-allocator fragmentation: reserved/allocated is typically 1.05-1.15 in FSDP training.
DEFAULT_HEADROOM_FRACTION = 0.10


def canonical(value: str, allowed: tuple[str, ...], what: str, aliases: dict[str, str] | None = None) -> str:
    v = value.strip().lower().replace("_", "-")
    v = (aliases or {}).get(v, v)
    if v not in allowed:
        raise UnknownNameError(f"unknown {what} {value!r}", hint="choose one of: " + ", ".join(allowed))
    return v


@dataclass(frozen=True)
class TrainSetup:
    """How the model is trained and on how many GPUs. The strategy and the tp/pp degrees become `dims` (one
    ParallelDims) in __post_init__; everything below reads the degrees, never the strategy name."""

    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    strategy: str = "full_shard"
    engine: str = "fsdp2"
    nodes: int = 1
    gpus_per_node: int = 1
    tp: int = 1
    """Tensor-parallel degree (assumed with sequence parallelism, so activations divide by tp too)."""
    pp: int = 1
    """Pipeline-parallel degree (1F1B: the first stage holds pp micro-batches in flight)."""
    micro_batch_size: int = 1
    seq_len: int = 2048
    checkpointing: str = "none"
    """none | selective | partial:K | full (llmctl.spec.checkpointing)."""
    attention: str = "sdpa"
    loss_chunk_tokens: int = 0
    """0: whole logits; N: the LM head and loss over chunks of N tokens (llmctl.engine.loss)."""
    fused_optimizer: bool = True
    """Fused AdamW (the GPU default) has no step temporaries; foreach materialises some."""
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    dims: ParallelDims = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", canonical(self.precision, PRECISIONS, "precision"))
        object.__setattr__(
            self,
            "optimizer",
            canonical(self.optimizer, OPTIMIZERS, "optimizer", {"adam": "adamw", "adamw8bit": "adamw-8bit"}),
        )
        object.__setattr__(self, "strategy", canonical_strategy(self.strategy))
        object.__setattr__(self, "engine", canonical(self.engine, ENGINES, "engine"))
        object.__setattr__(self, "checkpointing", ckpt_modes.parse(self.checkpointing))
        object.__setattr__(self, "attention", canonical(self.attention, ATTENTIONS, "attention"))
        for name in ("nodes", "gpus_per_node", "tp", "pp", "micro_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {getattr(self, name)}")
        if self.loss_chunk_tokens < 0:
            raise InputError(f"loss chunk must be >= 0 tokens, got {self.loss_chunk_tokens}")
        if self.cuda_context_bytes < 0 or not 0 <= self.headroom_fraction < 1:
            raise InputError("CUDA context must be >= 0 and headroom in [0, 1)")
        if self.strategy == "hybrid_shard" and self.nodes < 2:
            raise InputError(
                "hybrid_shard needs at least 2 nodes (on one node it is full_shard)",
                hint="pass --nodes N --gpus-per-node G",
            )
        dims = ParallelDims.from_strategy(self.strategy, self.nodes, self.gpus_per_node, self.tp, self.pp)
        object.__setattr__(self, "dims", dims)
        if self.engine == "fsdp2" and self.strategy == "zero1":
            raise InputError("FSDP2 has no ZeRO-1 (optimizer-only sharding)", hint="use --engine zero")
        if self.attention == "flash" and self.precision == "fp32":
            raise InputError("flash attention needs bf16 or fp16", hint="use --attention sdpa with fp32")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def shard_degree(self) -> int:
        """Ranks one model replica's sharded states are split over."""
        return self.dims.dp_shard

    @property
    def compute_bytes(self) -> int:
        return prec.compute_bytes(self.precision)

    @property
    def training(self) -> bool:
        return self.optimizer != "none"


# --- model states ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateLine:
    """One line of the model-state ledger."""

    name: str
    bytes_per_param: float
    sharded_from_stage: int
    """ZeRO stage from which this state is sharded over the data-parallel ranks (4: never)."""
    note: str = ""


def optimizer_bytes_per_param(spec: ModelSpec, optimizer: str, state_bytes: int) -> float:
    """Optimizer state bytes per parameter; state_bytes is 4 for fp32 states, 2 for bf16 states."""
    if optimizer == "adamw":
        return 2 * state_bytes  # exp_avg + exp_avg_sq
    if optimizer in ("lion", "sgd"):
        return state_bytes  # one momentum buffer
    if optimizer == "adamw-8bit":
        # bitsandbytes 8-bit AdamW: two uint8 states + one fp32 absmax per 256-element block per state.
        return 2 + 2 * 4 / 256
    if optimizer == "adafactor":
        # Adafactor (Shazeer & Stern 2018) without momentum (transformers' default beta1=None): a factored second
        # moment, rows + cols per matrix (per expert for 3-D MoE weights), the full vector for 1-D tensors.
        total = 0
        blocks = [(layer.tensors(spec.hidden_size), n) for layer, n in spec.layer_groups]
        if spec.is_gpt2:
            blocks = [(spec.layer_tensors(), spec.num_layers)]
        for tensors, count in (
            *blocks,
            (spec.embedding_tensors(), 1),
            (spec.head_tensors(), 1),
        ):
            for _, shape in tensors:
                lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
                n = shape[0] if len(shape) == 1 else lead * (shape[-2] + shape[-1])
                total += count * n * state_bytes
        return total / spec.shape_params
    return 0.0


def state_ledger(spec: ModelSpec, setup: TrainSetup) -> list[StateLine]:
    p, opt = setup.precision, setup.optimizer
    if not setup.training:
        return [StateLine(f"weights ({'fp32' if p == 'fp32' else 'half'})", 4 if p == "fp32" else 2, 3)]
    if p == "fp32":
        return [
            StateLine("parameters (fp32)", 4, 3),
            StateLine("gradients (fp32)", 4, 2),
            StateLine(f"optimizer states ({opt})", optimizer_bytes_per_param(spec, opt, 4), 1),
        ]
    if p == "bf16":
        return [
            StateLine("parameters (bf16)", 2, 3),
            StateLine("gradients (bf16)", 2, 2),
            StateLine(f"optimizer states ({opt}, bf16)", optimizer_bytes_per_param(spec, opt, 2), 1),
        ]
    half = p.split("-")[0]
    opt_line = StateLine(f"optimizer states ({opt})", optimizer_bytes_per_param(spec, opt, 4), 1)
    if setup.engine == "fsdp2":
        return [
            StateLine("parameters (fp32 master, sharded)", 4, 3),
            StateLine(f"{half} weights", 0, 3, note="FSDP2: transient only, see 'unsharded layers'"),
            StateLine("gradients (fp32)", 4, 2),
            opt_line,
        ]
    # ZeRO keeps the fp32 master copy inside the optimizer partition (stage 1) and the half weights as the model.
    return [
        StateLine("master weights (fp32)", 4, 1),
        StateLine(f"{half} weights", 2, 3),
        StateLine("gradients (fp32)", 4, 2),
        opt_line,
    ]


def classic_bytes_per_param(spec: ModelSpec, setup: TrainSetup) -> float:
    """The model-state budget before sharding with a persistent half copy (18 for mixed-precision AdamW)."""
    return sum(line.bytes_per_param for line in state_ledger(spec, replace(setup, engine="zero", strategy="no_shard")))


def _stage_params(spec: ModelSpec, setup: TrainSetup) -> tuple[int, int]:
    """(parameters held by the largest pipeline stage after TP division, layers on it)."""
    layers = math.ceil(spec.num_layers / setup.pp)
    if setup.tp == setup.pp == 1:
        return spec.params, layers

    def tp_params(layer: Layer) -> float:
        if spec.measured is not None:
            return spec.params_of(layer) / setup.tp
        norms = sum(math.prod(s) for n, s in layer.tensors(spec.hidden_size) if "norm" in n)
        return (spec.params_of(layer) - norms) / setup.tp + norms  # norms are replicated under TP

    per = {layer: tp_params(layer) for layer, _ in spec.layer_groups}
    stages = [spec.layers[i : i + layers] for i in range(0, spec.num_layers, layers)]
    ends = [spec.embedding_params / setup.tp, spec.head_params / setup.tp]
    if setup.pp > 1:
        # The first stage holds the embedding, the last the head; the largest stage decides.
        totals = [sum(per[la] for la in st) for st in stages]
        totals[0] += ends[0]
        totals[-1] += ends[1]
        return int(round(max(totals))), layers
    return int(round(sum(per[la] for la in spec.layers) + sum(ends))), layers


# --- activations -------------------------------------------------------------------------------------------------
def _norm_bytes(spec: ModelSpec, n: int, rows: int, ab: int) -> int:
    """What one RMSNorm over `n` elements (rows = tokens, or tokens x heads for per-head norms) keeps for backward:
    HF's LlamaRMSNorm keeps its input upcast to fp32 (4n), the fp32 rsqrt (4 per row) and the normalised output in
    the compute dtype (for the weight's gradient). Norms that multiply by the weight in fp32 (OLMo 2, gpt-oss:
    `(w * x).to(dtype)`; Gemma: `x * (1 + w)`) keep the normalised output in fp32 (4n); Gemma's also keeps the
    (1 + w) vector (4 x width)."""
    if spec.model_type in GEMMA_NORM:
        return 8 * n + 4 * rows + 4 * (n // max(1, rows))
    if spec.model_type in FP32_WEIGHT_NORM:
        return 8 * n + 4 * rows
    return (4 + ab) * n + 4 * rows


GEMMA_NORM = {"gemma2", "gemma3_text"}
FP32_WEIGHT_NORM = {"olmo2", "gpt_oss"}
DROPOUT_MASK_BYTES = 1
"""On CUDA, dropout (torch.native_dropout) keeps a bool mask: 1 byte per element. (On the CPU, F.dropout keeps its
mask in the input's dtype: the CPU measurements in the tests pass mask_bytes=act_bytes.)"""


def block_activation_terms(
    spec: ModelSpec, layer: Layer, b: int, s: int, act_bytes: int, attention: str, mask_bytes: int = DROPOUT_MASK_BYTES
) -> dict[str, int]:
    """Bytes one decoder block saves for backward, by tensor group (micro-batch b, sequence s, no TP).

    Derived tensor by tensor from what the Hugging Face modules save (torch.autograd.graph.saved_tensors_hooks;
    tests/plan/test_memory_measured.py and tests/plan/test_families_measured.py re-measure every family):
    - Llama-style block: each RMSNorm keeps its fp32 input, rsqrt and normalised output (_norm_bytes); q/k/v share
      one saved input; SDPA/flash keep q, k, v (native GQA: kv heads only), the output and a fp32 logsumexp
      (b*a*s); eager keeps k/v repeated to all heads, the softmax output in fp32 and again in the compute dtype
      (b*a*s^2 each), and the o_proj input; the gated MLP (SwiGLU, Gemma's GeGLU) keeps its input, gate, up,
      act(gate) and their product (4 x sbi).
    - q/k norms (Qwen3, Gemma 3 per head; OLMo 2 over the projection) are norms over q and k; Gemma's extra
      pre/post feed-forward norms and OLMo 2's post-norms are norms over the hidden size.
    - MoE (transformers' expert loop): the router's logits and probabilities (fp32, E per token), then per routed
      token copy its gathered input, gate/up, act, product and the routing weight; shared experts are a dense MLP.
      Llama 4's MoE (Llama4TextMoe) is dense over experts instead: every token through all E experts.
    - MLA: the latent path (q_a, its norm, kv_a, its norm) then per-head q/k/v of qk and v widths.
    - Dropout with p > 0 keeps a mask (1 byte/element, bool) per dropped tensor: attention probabilities (eager),
      and the residual branches (GPT-2's resid_pdrop twice per block).
    - GPT-2 block: LayerNorms keep input + mean + rstd; c_attn's output holds q, k, v in one tensor (3sbh); the
      gelu_new MLP keeps 5 tensors of size sbi; eager keeps one softmax tensor (b*a*s^2).
    """
    h, sb, ab = spec.hidden_size, s * b, act_bytes
    at, m = layer.attention, layer.mlp
    a, kv, d, dv = at.num_heads, at.num_kv_heads, at.head_dim, at.v_head_dim
    eager = attention == "eager"
    s2 = b * a * s * s
    if spec.is_gpt2:
        i = m.intermediate_size
        norm = 2 * (ab * sb * h + 2 * ab * sb)  # ln_1, ln_2: input + mean + rstd
        terms = {
            "norms": norm,
            "attention inputs/outputs": ab * sb * h * (1 + 3 + 1) + ab * sb * h,  # c_attn in, qkv, out, ln_2 out
            "mlp": 5 * ab * sb * i,
        }
        if eager:
            terms["attention scores (s^2)"] = (4 if ab == 4 else 2) * s2
        else:
            terms["attention logsumexp"] = 4 * b * a * s
        _dropout_terms(spec, terms, sb, h, s2, eager, ab, mask_bytes)
        return terms
    norm_n = len(layer.norms)
    terms = {"norms": norm_n * _norm_bytes(spec, sb * h, sb, ab) - norm_n * 4 * sb * h}
    # Split as before: what a lean block keeps too, and HF's fp32 upcast copies (4sbh per norm) on top.
    terms["norms: HF fp32 upcast copy"] = norm_n * 4 * sb * h
    # SDPA with an explicit mask (a sliding-window or chunked layer past its window): transformers repeats k and v to every head
    # (no native GQA with a mask) and torch turns the boolean mask into an additive one in the compute dtype, which
    # the kernel keeps for backward; each layer converts its own.
    masked = attention == "sdpa" and bool(at.window) and s > at.window
    kv_heads = a if eager or masked else kv
    if masked:
        terms["sliding-window mask (sdpa, b*s^2)"] = ab * b * s * s
    if at.mla:
        c, r, rope = at.kv_lora_rank, at.q_lora_rank, at.rope_dim
        latent = ab * sb * h  # the block input to q_a / kv_a (one storage)
        if r:
            latent += ab * sb * r + _norm_bytes(spec, sb * r, sb, ab)  # q_a output (its norm's input), q_a norm
            latent += ab * sb * r  # q_b input (the norm's output)
        latent += ab * sb * (c + rope) + _norm_bytes(spec, sb * c, sb, ab) + ab * sb * c  # kv_a out, norm, kv_b in
        terms["attention latent (MLA)"] = latent
        terms["attention inputs/outputs"] = ab * sb * (a * d + a * d + a * dv) + ab * sb * a * dv
    else:
        v_storage = kv_heads * dv
        if at.fused_qkv and kv_heads == kv:
            # Phi-3: v is a view of the fused qkv output, so SDPA (or eager without GQA repeats) keeps that whole
            # storage alive, not just v's share.
            v_storage = a * d + kv * d + kv * dv
        terms["attention inputs/outputs"] = (
            ab * sb * h + ab * sb * (a * d + kv_heads * d + v_storage) + ab * sb * a * dv
        )
        if spec.model_type == "phi3" and not eager:
            # Phi-3 rotates with torch.cat, which leaves q contiguous as (b, a, s, d); a fused kernel writes its
            # output in q's layout (CUDA flash: empty_like(q)), so transformers' transpose(1, 2).contiguous() copies
            # it: o_proj keeps that copy next to the kernel's own output (Llama's q stays (b, s, a, d): no copy).
            terms["attention output copy (rotary by cat)"] = ab * sb * a * dv
    if at.qk_norm in ("head", "proj"):
        rows_q, rows_k = (sb * a, sb * kv) if at.qk_norm == "head" else (sb, sb)
        terms["q/k norms"] = _norm_bytes(spec, sb * a * d, rows_q, ab) + _norm_bytes(spec, sb * kv * d, rows_k, ab)
    elif at.qk_norm == "l2":
        # Llama 4's weightless L2 norm per head, x.float() * rsqrt(mean(x^2)): it keeps its fp32 input (fp32: the
        # rotary complex product itself; bf16: the upcast copy) and an fp32 rsqrt per head row. No weight: its
        # output is kept only by attention (q, k above).
        terms["q/k norms (l2)"] = 4 * sb * (a + kv) * d + 4 * sb * (a + kv)
    if m.moe and spec.model_type == "llama4_text":
        i, k, e = m.intermediate_size, m.experts_per_token, m.num_experts
        terms["mlp"] = ab * sb * h  # the MoE input: router, routed copies and shared expert read it
        # Llama4Router: top-k of the logits scattered into -inf, sigmoid in fp32 (kept: E per token), the top-k
        # indices (int64, scatter's backward) and the scores in the compute dtype, transposed to (E*tokens, 1) (a
        # copy, kept by the multiply for the expert inputs' gradient).
        terms["moe router"] = sb * (4 * e + 8 * k + ab * e)
        # Llama4TextMoe runs every token through every expert, scaled by its score (0 off its top-k): the input
        # repeated E times (kept for the scores' gradient), its scaled copy (the bmm input), the gate_up output,
        # act(gate) and the product (down's input), all E x tokens rows.
        terms["moe experts (every token, every expert)"] = e * sb * ab * (2 * h + 4 * i)
        terms["shared expert"] = 4 * ab * sb * m.shared_size
    elif m.moe:
        i, k, e = m.intermediate_size, m.experts_per_token, m.num_experts
        terms["mlp"] = ab * sb * h
        # transformers' grouped-mm experts: the router keeps its fp32 probabilities (E per token), the top-k indices
        # (int64) and weights and their sum; then per (token, expert) pair the gathered input, the gate_up output,
        # act(gate) and the product (down's input), the down output (for the routing weight's gradient), the
        # routing weight and three int64 permutation indices. gpt-oss's clamped GLU keeps 3 more i-wide tensors.
        terms["moe router"] = sb * (4 * e + 12 * k + 4)
        if spec.model_type == "deepseek_v3" and ab != 4:
            # DeepSeek-V3's router runs in fp32: its linear keeps an fp32 copy of the block's hidden states, and the
            # routing weights gathered from the fp32 sigmoid scores keep E more fp32 values per token (measured on
            # fake tensors, tests/engine/test_fakemeasure.py).
            terms["moe router fp32 input"] = 4 * sb * (h + e)
        glu = 7 if m.act == "swiglu-clamped" else 4
        terms["moe dispatched tokens"] = k * sb * (ab * (2 * h + glu * i) + 4 + 8 * (4 if m.expert_bias else 3))
        if m.shared_size:
            terms["shared expert"] = 4 * ab * sb * m.shared_size
    else:
        i = m.intermediate_size
        # the MLP input, gate and up outputs (for act's and the product's backward) and the product (down's input).
        terms["mlp"] = ab * sb * h + 3 * ab * sb * i
        # HF's act_fn(gate) * up keeps act(gate) as its own tensor; a fused SwiGLU (Liger's, or torch.compile's
        # fusion) recomputes it from gate in backward: ab*sbi per layer more.
        terms["mlp: HF silu(gate) kept"] = ab * sb * i
    if eager:
        if at.sinks:
            # gpt-oss: softmax over the scores and one sink logit per row (b*a*s*(s+1), compute dtype), the row
            # max's int64 index; the AV matmul keeps a slice of the softmax output (same storage).
            terms["attention scores (s^2)"] = ab * b * a * s * (s + 1) + 8 * b * a * s
        elif spec.model_type == "llama4_text":
            # Llama 4's eager softmax runs in the compute dtype (no fp32 upcast): one s^2 tensor.
            terms["attention scores (s^2)"] = ab * s2
        else:
            terms["attention scores (s^2)"] = (4 if ab == 4 else 4 + 2) * s2
        if at.softcap:  # Gemma 2: tanh(scores / cap) keeps its output
            terms["attention softcap (s^2)"] = ab * s2
    else:
        terms["attention logsumexp"] = 4 * b * a * s
    _dropout_terms(spec, terms, sb, h, s2, eager, ab, mask_bytes)
    return terms


def _dropout_terms(
    spec: ModelSpec, terms: dict[str, int], sb: int, h: int, s2: int, eager: bool, ab: int, mask_bytes: int
) -> None:
    """Dropout keeps its mask for backward (mask_bytes per element). On the attention probabilities (eager) the
    dropped copy is what the AV matmul keeps, next to the softmax output its own backward keeps: a second s^2
    tensor. On the residual branches (GPT-2's resid_pdrop after attn.c_proj and mlp.c_proj) the dropped output goes
    into the residual add, which keeps nothing: the mask only. SDPA and flash drop inside the kernel (on a GPU they
    keep a Philox seed, no mask)."""
    if spec.attention_dropout > 0 and eager:
        terms["dropout (attention probabilities)"] = s2 * (mask_bytes + ab)
    if spec.resid_dropout > 0:
        terms["dropout masks (residual)"] = 2 * sb * h * mask_bytes


def layer_activation_terms(
    spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, layer: Layer | None = None
) -> dict[str, int]:
    """Bytes one block saves for backward by tensor group: the given block, else the model's largest. A measured
    model has no groups: its block's measured bytes, as one line."""
    if spec.measured is not None:
        layer = layer or largest_block(spec, b, s, act_bytes, attention)
        return {"block, measured on fake tensors": layer_activation_bytes(spec, b, s, act_bytes, attention, layer)}
    return block_activation_terms(
        spec, layer or largest_block(spec, b, s, act_bytes, attention), b, s, act_bytes, attention
    )


def largest_block(spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str) -> Layer:
    return max(
        (layer for layer, _ in spec.layer_groups),
        key=lambda la: layer_activation_bytes(spec, b, s, act_bytes, attention, la),
    )


def layer_activation_bytes(
    spec: ModelSpec,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    layer: Layer | None = None,
    mask_bytes: int = DROPOUT_MASK_BYTES,
) -> int:
    """Bytes one block saves for backward (the given one, else the first)."""
    layer = layer or spec.layers[0]
    if spec.measured is not None:
        return measured_saved_bytes(spec, layer, b, s, act_bytes, attention, "none")
    return sum(block_activation_terms(spec, layer, b, s, act_bytes, attention, mask_bytes).values())


def measured_saved_bytes(
    spec: ModelSpec, layer: Layer, b: int, s: int, act_bytes: int, attention: str, checkpointing: str
) -> int:
    """A measured model's block: a*b*s + c*b*s^2 from the fit on fake tensors (flash behaves as sdpa: both keep no
    s^2 tensor)."""
    assert spec.measured is not None
    attn = "eager" if attention == "eager" else "sdpa"
    key = f"{4 if act_bytes == 4 else 2}/{attn}/{'full' if checkpointing == 'full' else 'none'}"
    lin, quad = spec.measured["saved"][key][layer.measured_kind]
    return int(round(lin * b * s + quad * b * s * s))


def selective_layer_terms(
    spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, layer: Layer | None = None
) -> dict[str, int]:
    """Bytes one block keeps for backward under selective checkpointing (the engine's op policy): its input (the
    checkpoint's argument), the outputs of every other matmul (flops.selective_kept: q, v, gate, down in a Llama
    block; c_attn and c_fc in GPT-2's; per MoE token the router and each expert's down) and a fused attention
    kernel's output and fp32 logsumexp. Everything else is regenerated in backward. Measured exact to the byte
    (tests/plan/test_memory_checkpointing.py)."""
    layer = layer or spec.layers[0]
    sb, ab = s * b, act_bytes
    kept = [o for (_, _, o), k in zip(fl.layer_matmuls(spec, layer), fl.selective_kept(spec, layer)) if k]
    terms = {"block input": ab * sb * spec.hidden_size, "kept matmul outputs": ab * sb * sum(kept)}
    if attention != "eager":
        at = layer.attention
        terms["attention output + logsumexp"] = ab * sb * at.num_heads * at.v_head_dim + 4 * b * at.num_heads * s
    return terms


def layer_saved_bytes(
    spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, checkpointing: str, layer: Layer | None = None
) -> int:
    """Bytes a block keeps for backward in a mode (partial:K: use stage_activation_bytes, it differs per layer)."""
    layer = layer or spec.layers[0]
    if checkpointing == "full":
        if spec.measured is not None:  # what the checkpoint keeps, measured (the block input, or more)
            return measured_saved_bytes(spec, layer, b, s, act_bytes, attention, "full")
        return act_bytes * b * s * spec.hidden_size
    if checkpointing == "selective":
        if spec.measured is not None:  # not measured: bounded by the two measured modes, take the no-checkpoint one
            return measured_saved_bytes(spec, layer, b, s, act_bytes, attention, "none")
        return sum(selective_layer_terms(spec, b, s, act_bytes, attention, layer).values())
    return layer_activation_bytes(spec, b, s, act_bytes, attention, layer)


def stage_activation_bytes(
    spec: ModelSpec, layers: int, b: int, s: int, act_bytes: int, attention: str, checkpointing: str
) -> int:
    """Bytes `layers` consecutive blocks from the first keep for backward (partial:K checkpoints layers // K of them
    whole). Past the last block the pattern repeats (a what-if deeper stack of the same blocks)."""
    blocks = [spec.layers[i % spec.num_layers] for i in range(layers)]
    if ckpt_modes.partial_every(checkpointing):
        whole = set(ckpt_modes.whole_layers(checkpointing, layers))
        return sum(
            layer_saved_bytes(spec, b, s, act_bytes, attention, "full" if i in whole else "none", layer)
            for i, layer in enumerate(blocks)
        )
    counts: dict[Layer, int] = {}
    for layer in blocks:
        counts[layer] = counts.get(layer, 0) + 1
    return sum(n * layer_saved_bytes(spec, b, s, act_bytes, attention, checkpointing, la) for la, n in counts.items())


def recompute_buffer_bytes(spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, checkpointing: str) -> int:
    """Live at once while one checkpointed block's backward runs: what its recompute regenerates (the largest
    block's). A whole block (full, partial) regenerates everything it would have saved; a selective block the part
    it did not keep."""
    if checkpointing == "none":
        return 0
    worst = 0
    for layer, _ in spec.layer_groups:
        none = layer_activation_bytes(spec, b, s, act_bytes, attention, layer)
        if checkpointing == "selective":
            sel = layer_saved_bytes(spec, b, s, act_bytes, attention, "selective", layer)
            none = max(0, none - (sel - act_bytes * b * s * spec.hidden_size))
        worst = max(worst, none)
    return worst


def shared_activation_bytes(spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str) -> int:
    """Kept once for all blocks: the attention masks and, for rotary models, the cos/sin tables (1 x s x rotary dim
    each, compute dtype: Hugging Face builds position ids of batch 1; Gemma 3 keeps a second pair for its local
    layers). Eager attention keeps its materialised causal mask (b x 1 x s x s, compute dtype; a second one when
    sliding-window and global layers mix). SDPA and flash take is_causal and build none (a sliding-window layer's
    SDPA mask is that layer's: block_activation_terms)."""
    windows = {la.attention.window for la in spec.layers if not la.attention.chunked}
    sliding = any(windows)
    # SDPA: the sliding-window layers' masks are the layers' own (block_activation_terms); flash takes the window.
    mask = (2 if sliding and len(windows) > 1 else 1) * act_bytes * b * s * s if attention == "eager" else 0
    if spec.is_gpt2 or spec.measured is not None:
        return mask
    at = spec.layers[0].attention
    rot = at.rope_dim if at.mla else at.head_dim
    if spec.model_type == "llama4_text":
        # Llama 4 builds a mask per layer type present (chunked, full: eager materialises each, b x 1 x s x s), and
        # its rotary table is one complex64 freqs_cis (1 x s x d/2: 4 bytes per rotary dim) whatever the dtype.
        types = len({la.attention.chunked for la in spec.layers})
        return (types * act_bytes * b * s * s if attention == "eager" else 0) + 4 * s * rot
    tables = 2 if spec.model_type == "gemma3_text" else 1
    return mask + tables * 2 * s * rot * act_bytes


def head_activation_bytes(spec: ModelSpec, b: int, s: int, act_bytes: int) -> int:
    """Saved by the final norm and the LM head input, plus the token ids (embedding and labels, int64)."""
    sb, h = s * b, spec.hidden_size
    if spec.is_gpt2:
        norm = act_bytes * sb * h + 2 * act_bytes * sb
    else:
        norm = _norm_bytes(spec, sb * h, sb, act_bytes)
    softcap = act_bytes * sb * spec.vocab_size if spec.final_logit_softcapping else 0  # tanh keeps its output
    embd_dropout = DROPOUT_MASK_BYTES * sb * h if spec.embd_dropout > 0 else 0  # GPT-2's embedding dropout mask
    return norm + act_bytes * sb * h + 8 * sb * 2 + softcap + embd_dropout


def loss_chunk_forward_bytes(spec: ModelSpec, chunk: int, act_bytes: int) -> int:
    """Chunked loss, forward: one chunk's logits and fp32 copy exist while its loss is computed, then are freed."""
    return (act_bytes + 4) * chunk * spec.vocab_size


def loss_chunk_backward_bytes(spec: ModelSpec, chunk: int, act_bytes: int) -> int:
    """Chunked loss, backward, the larger of two moments (measured, fp32 and bf16): one chunk's recomputed fp32
    log-softmax, its gradient and the logits' gradient (3 x 4*c*V); or, in the LM head's backward, two of them and that
    chunk's weight gradient (V*h, compute dtype) before it is added to the accumulated one."""
    v, h = spec.vocab_size, spec.hidden_size
    return max(12 * chunk * v, 8 * chunk * v + act_bytes * v * h)


# --- the estimate ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    phases: tuple[str, ...]
    """Phases in which this memory is live: forward, backward, optimizer."""
    bytes_per_param: float | None = None
    note: str = ""


@dataclass(frozen=True)
class MemoryEstimate:
    spec: ModelSpec
    setup: TrainSetup
    components: list[Component]
    phase_bytes: dict[str, int]
    ledger: list[StateLine] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phase_bytes, key=lambda k: self.phase_bytes[k])

    @property
    def peak_allocated_bytes(self) -> int:
        return self.phase_bytes[self.peak_phase]

    @property
    def headroom_bytes(self) -> int:
        return int(self.peak_allocated_bytes * self.setup.headroom_fraction)

    @property
    def peak_reserved_bytes(self) -> int:
        return self.peak_allocated_bytes + self.headroom_bytes

    @property
    def device_bytes(self) -> int:
        """What the device must hold: reserved + CUDA context (compare with the GPU's memory)."""
        return self.peak_reserved_bytes + self.setup.cuda_context_bytes

    @property
    def model_state_bytes(self) -> int:
        return sum(c.bytes for c in self.components if c.bytes_per_param is not None)

    def per_component(self) -> dict[str, int]:
        """Bytes per component live at the peak phase, plus headroom and context: sums to device_bytes."""
        out = {c.name: c.bytes for c in self.components if self.peak_phase in c.phases}
        out["allocator headroom"] = self.headroom_bytes
        out["CUDA context + NCCL"] = self.setup.cuda_context_bytes
        return out


def estimate(spec: ModelSpec, setup: TrainSetup) -> MemoryEstimate:
    """Per-GPU memory of one training step (see module docstring for what is predicted)."""
    stage_params, stage_layers = _stage_params(spec, setup)
    ledger = state_ledger(spec, setup)
    dims = setup.dims
    comps: list[Component] = []
    for line in ledger:
        # FSDP2 shards every state at rest (SHARD_GRAD_OP differs only while computing); ZeRO by its stage.
        deg = dims.dp_shard if setup.engine == "fsdp2" else dims.shard_degree(line.sharded_from_stage)
        comps.append(
            Component(
                line.name,
                int(math.ceil(stage_params * line.bytes_per_param / deg)),
                ("forward", "backward", "optimizer"),
                bytes_per_param=line.bytes_per_param / deg,
                note=line.note,
            )
        )
    b, s, cb = setup.micro_batch_size, setup.seq_len, setup.compute_bytes
    layer_params = spec.params_per_layer / setup.tp
    sharded_params = setup.engine == "fsdp2" or dims.zero_stage == 3
    if sharded_params and dims.dp_shard > 1:
        # FSDP all-gathers a layer's parameters in the compute dtype just before use and frees them after;
        # with prefetch, the next layer is gathered while the current one computes: two layers live.
        # SHARD_GRAD_OP (reshard_after_forward=False) keeps every layer unsharded from forward to backward.
        n_layers = stage_layers if dims.zero_stage == 2 else min(2, stage_layers)
        unsharded = int(n_layers * layer_params * cb * (1 - 1 / dims.dp_shard))
        comps.append(Component("unsharded layers (FSDP all-gather)", unsharded, ("forward", "backward")))
    if setup.training and dims.dp_shard > 1:
        # Backward: one layer's full gradients in the compute dtype, upcast to fp32 for the reduce-scatter.
        grad_buf = int(layer_params * (cb + 4 if cb != 4 else 4))
        comps.append(Component("unsharded layer gradients (reduce-scatter)", grad_buf, ("backward",)))

    # Activations: with TP we assume sequence parallelism (Korthikanti et al. 2022): everything divides by tp.
    in_flight = setup.pp  # 1F1B: the first stage holds pp micro-batches
    one_layer = max(layer_activation_bytes(spec, b, s, cb, setup.attention, la) for la, _ in spec.layer_groups)
    one_layer //= setup.tp
    if not setup.training:
        comps.append(Component("activations (one layer, forward only)", one_layer, ("forward",)))
        comps.append(Component("logits", cb * b * s * spec.vocab_size // setup.tp, ("forward",)))
    else:
        ck, attn = setup.checkpointing, setup.attention
        saved = in_flight * stage_activation_bytes(spec, stage_layers, b, s, cb, attn, ck) // setup.tp
        saved += shared_activation_bytes(spec, b, s, cb, attn) // setup.tp
        what = {"none": "saved for backward", "full": "block inputs, checkpointed"}.get(ck, f"{ck} checkpointing")
        what += ", measured on fake tensors" if spec.measured is not None else ""
        comps.append(Component(f"activations ({what})", saved, ("forward", "backward")))
        if ck != "none":
            rec = recompute_buffer_bytes(spec, b, s, cb, attn, ck) // setup.tp
            comps.append(Component("recomputed block (backward)", rec, ("backward",)))
        head = head_activation_bytes(spec, b, s, cb) // setup.tp
        comps.append(Component("final norm + LM-head input", head, ("forward", "backward")))
        chunk = min(setup.loss_chunk_tokens, b * s)
        if chunk:
            fwd_chunk = loss_chunk_forward_bytes(spec, chunk, cb) // setup.tp
            comps.append(Component(f"loss chunk of {chunk} tokens (forward)", fwd_chunk, ("forward",)))
            bwd_chunk = loss_chunk_backward_bytes(spec, chunk, cb) // setup.tp
            comps.append(Component(f"loss chunk of {chunk} tokens (backward)", bwd_chunk, ("backward",)))
        else:
            # The loss keeps its fp32 log-softmax for backward; the logits (and their fp32 upcast) live only until the
            # loss is computed (the engine's whole_loss, and HF Trainer's compute_loss, drop them before backward).
            bsv = b * s * spec.vocab_size // setup.tp
            comps.append(Component("loss log-softmax (fp32, b*s*V)", 4 * bsv, ("forward", "backward")))
            comps.append(Component("logits (b*s*V, until the loss)", (cb + (4 if cb != 4 else 0)) * bsv, ("forward",)))
            # Backward through the loss: fp32 grad of the log-softmax and of the logits (2 x 4*b*s*V) live at once.
            comps.append(Component("loss backward buffers", 8 * bsv, ("backward",)))
        if not setup.fused_optimizer:
            # torch's foreach AdamW materialises per-group temporaries about the size of the local fp32 shard.
            shard = next(c.bytes for c in comps if c.bytes_per_param is not None)
            comps.append(Component("optimizer step temporaries (foreach)", shard, ("optimizer",)))
    phases = {ph: sum(c.bytes for c in comps if ph in c.phases) for ph in ("forward", "backward", "optimizer")}
    if not setup.training:
        phases = {"forward": phases["forward"]}
    return MemoryEstimate(spec=spec, setup=setup, components=comps, phase_bytes=phases, ledger=ledger)


def fits(est: MemoryEstimate, device_memory_bytes: int) -> bool:
    return est.device_bytes <= device_memory_bytes


def max_micro_batch(spec: ModelSpec, setup: TrainSetup, device_memory_bytes: int, limit: int = 65536) -> int:
    """Largest micro-batch that fits (0 if none). Memory is non-decreasing in b and close to linear (activations grow
    with b, states do not; the chunked loss's lines stop growing at one chunk): a first guess from the slope between
    b=1 and b=2, then a bracket around it and a binary search to the exact boundary (3-6 estimates, not 2 log2(b))."""

    def fit(b: int) -> bool:
        return fits(estimate(spec, replace(setup, micro_batch_size=b)), device_memory_bytes)

    one = estimate(spec, replace(setup, micro_batch_size=1))
    if not fits(one, device_memory_bytes):
        return 0
    if limit < 2:
        return 1
    two = estimate(spec, replace(setup, micro_batch_size=2))
    if not fits(two, device_memory_bytes):
        return 1
    slope = two.device_bytes - one.device_bytes
    guess = limit if slope <= 0 else min(limit, max(2, 1 + (device_memory_bytes - one.device_bytes) // slope))
    # Bracket: lo fits, hi does not (or hi = limit + 1), widening geometrically from the guess.
    if fit(guess):
        lo, step = guess, 1
        hi = lo + step
        while hi <= limit and fit(hi):
            lo, step = hi, step * 2
            hi = lo + step
        hi = min(hi, limit + 1)
    else:
        hi, step = guess, 1
        lo = max(2, hi - step)
        while lo > 2 and not fit(lo):
            hi, step = lo, step * 2
            lo = max(2, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fit(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class MinGpus:
    strategy: str
    gpus: int | None
    """Fewest GPUs that fit (None: no count of this GPU kind fits)."""
    nodes: int | None
    device_bytes: int | None
    """Per-GPU requirement at that count."""
    note: str = ""


def min_gpus(
    spec: ModelSpec, setup: TrainSetup, device_memory_bytes: int, strategy: str, max_nodes: int = 4096
) -> MinGpus:
    """Fewest GPUs of this kind (whole nodes beyond one) on which `strategy` fits at the setup's micro-batch."""
    gpn = setup.gpus_per_node
    strategy = canonical_strategy(strategy)
    if setup.engine == "fsdp2" and strategy == "zero1":
        return MinGpus(strategy, None, None, None, "needs --engine zero")
    unit = setup.tp * setup.pp

    def est_at(nodes: int, per_node: int) -> MemoryEstimate:
        return estimate(spec, replace(setup, strategy=strategy, nodes=nodes, gpus_per_node=per_node))

    if strategy == "hybrid_shard":
        if gpn % setup.tp:
            return MinGpus(strategy, None, None, None, "tp does not divide GPUs per node")
        e = est_at(2, gpn)
        if fits(e, device_memory_bytes):
            return MinGpus(strategy, 2 * gpn, 2, e.device_bytes, "memory does not shrink with more nodes")
        return MinGpus(strategy, None, None, e.device_bytes, "does not fit when sharded over one node")
    # Inside one node: unit, 2*unit, ... up to gpus_per_node.
    for n in range(unit, gpn + 1, unit):
        if gpn % n and n != gpn:
            continue
        e = est_at(1, n)
        if fits(e, device_memory_bytes):
            return MinGpus(strategy, n, 1, e.device_bytes)
    if strategy == "no_shard":
        e = est_at(1, gpn)
        return MinGpus(strategy, None, None, e.device_bytes, "replicated states do not shrink with more GPUs")
    # Whole nodes: memory is non-increasing in nodes for sharded strategies; binary search.
    if gpn % unit or not fits(est_at(max_nodes, gpn), device_memory_bytes):
        e = est_at(max_nodes, gpn) if gpn % unit == 0 else None
        return MinGpus(
            strategy,
            None,
            None,
            e.device_bytes if e else None,
            f"does not fit even on {max_nodes} nodes" if e else "tp x pp does not divide GPUs per node",
        )
    lo, hi = 1, max_nodes  # lo: does not fit (checked above with n = gpn), hi: fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(est_at(mid, gpn), device_memory_bytes):
            hi = mid
        else:
            lo = mid
    e = est_at(hi, gpn)
    return MinGpus(strategy, hi * gpn, hi, e.device_bytes)
