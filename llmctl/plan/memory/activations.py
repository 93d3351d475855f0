"""Activations: what each decoder block, the head and the loss keep for backward, derived tensor by tensor from what
Hugging Face's blocks save (measured with torch.autograd.graph.saved_tensors_hooks; tests/plan/test_memory_measured.py
and tests/plan/test_families_measured.py re-measure them), for each checkpointing mode and attention kernel
(torch-free).

With tensor parallelism (`tp` > 1) the functions give one rank's bytes under torch's sequence parallelism as the
engine applies it (llmctl.engine.tensor_parallel; measured on 4 gloo ranks by tests/engine/test_tp_activations.py).
Unlike Megatron-LM's sequence parallelism (Korthikanti et al. 2022: every tensor divided by tp), autograd keeps the
*all-gathered* input of the column-parallel matmuls (q/k/v share one, gate/up another: b*s*h each, the whole
sequence), which Megatron re-gathers in backward instead. The rest splits one of three ways: the norms and the residual
stream hold this rank's s/tp tokens; attention's internals and the MLP's intermediates hold this rank's heads and
columns (/tp); the rotary tables and masks are built from the whole sequence on every rank (not split), as is a mixture
of experts (replicated over the tp group, on the gathered sequence). A checkpointed first layer holds the whole
sequence as its input (the embedding's all-reduced output; the layer cuts it to its shard inside the checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable

from llmctl.plan import flops as fl
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.attention import Attention
from llmctl.spec.layers import Attention as AttentionShape
from llmctl.spec.layers import Layer, Mlp
from llmctl.spec.models import ModelSpec


# --- activations -------------------------------------------------------------------------------------------------
def _norm_bytes(spec: ModelSpec, n: int, rows: int, ab: int) -> int:
    """What one RMSNorm over `n` elements (rows = tokens, or tokens x heads for per-head norms) keeps for backward:
    HF's LlamaRMSNorm keeps its input upcast to fp32 (4n), the fp32 rsqrt (4 per row) and the normalised output in
    the compute dtype (for the weight's gradient). Norms that multiply by the weight in fp32 (OLMo 2, gpt-oss:
    `(w * x).to(dtype)`; Gemma: `x * (1 + w)`) keep the normalised output in fp32 (4n); Gemma's also keeps the
    (1 + w) vector (4 x width)."""
    if spec.features.norm == "gemma":
        return 8 * n + 4 * rows + 4 * (n // max(1, rows))
    if spec.features.norm == "fp32_weight":
        return 8 * n + 4 * rows
    return (4 + ab) * n + 4 * rows


def _split(n: int, tp: int) -> int:
    """This rank's share of n things split over tp ranks (the first ranks' share when tp does not divide n)."""
    return -(-n // tp)


COLWISE = frozenset(
    (
        *("q_proj", "k_proj", "v_proj", "qkv_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "gate_up_proj"),
        *("c_attn", "c_fc"),  # GPT-2's Conv1D names
    )
)
"""Matmuls split by output columns under tensor parallelism (each rank: its heads / columns).
The row-parallel ones (o_proj, down_proj) produce a partial sum over the whole sequence, reduce-scattered afterwards;
any other (a router, experts, the latent projections of MLA) is replicated over the tp group."""


Terms = dict[str, int]
"""Bytes by tensor group, in the order a table shows them."""

DROPOUT_MASK_BYTES = 1
"""On CUDA, dropout (torch.native_dropout) keeps a bool mask: 1 byte per element. (On the CPU, F.dropout keeps its
mask in the input's dtype: the CPU measurements in the tests pass mask_bytes=act_bytes.)"""


def block_activation_terms(
    spec: ModelSpec,
    layer: Layer,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    mask_bytes: int = DROPOUT_MASK_BYTES,
    tp: int = 1,
) -> dict[str, int]:
    """Bytes one decoder block saves for backward on one rank, by tensor group (micro-batch b, sequence s, tensor
    parallel over tp ranks with torch's sequence parallelism: the module docstring).

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

    Under tensor parallelism (tp > 1) each term is what the rank's tensors hold: sbt = b*s/tp tokens for the norms
    (their inputs are the sequence-sharded residual stream, SequenceParallel), sb (the whole sequence) for the
    all-gathered inputs of q/k/v and gate/up (autograd keeps the gathered tensor), a/tp, kv/tp heads and i/tp columns
    for everything between a column-parallel and its row-parallel matmul, and sb for a mixture of experts
    (replicated). GPT-2 has no tensor-parallel plan in the engine: its terms apply the same rules.
    """
    h, ab = spec.hidden_size, act_bytes
    eager = Attention(attention).keeps_scores
    terms = BLOCK_TERMS[spec.features.block](spec, layer, b, s, ab, Attention(attention), tp)
    a = _split(layer.attention.num_heads, tp)
    _dropout_terms(spec, terms, b * _split(s, tp), h, b * a * s * s, eager, ab, mask_bytes)
    return terms


def _gpt2_block_terms(spec: ModelSpec, layer: Layer, b: int, s: int, ab: int, attention: Attention, tp: int) -> Terms:
    """GPT-2's block (block_activation_terms): LayerNorms, one fused c_attn output, a gelu_new MLP."""
    h, sb, sbt = spec.hidden_size, s * b, b * _split(s, tp)
    i = _split(layer.mlp.intermediate_size, tp)
    hl = _split(h, tp)  # this rank's heads x head size
    norm = 2 * (ab * sbt * h + 2 * ab * sbt)  # ln_1, ln_2: input + mean + rstd
    terms = {
        "norms": norm,
        # c_attn in (gathered under tp), qkv and out (this rank's heads), ln_2 out (c_fc's gathered input)
        "attention inputs/outputs": ab * sb * h + ab * sb * hl * (3 + 1) + ab * sb * h,
        "mlp": 5 * ab * sb * i,
    }
    a = _split(layer.attention.num_heads, tp)
    if attention.keeps_scores:
        terms["attention scores (s^2)"] = (4 if ab == 4 else 2) * b * a * s * s
    else:
        terms["attention logsumexp"] = 4 * b * a * s
    return terms


def _gated_block_terms(spec: ModelSpec, layer: Layer, b: int, s: int, ab: int, attention: Attention, tp: int) -> Terms:
    """A pre-norm block with a gated MLP or a mixture of experts (block_activation_terms), term group by group."""
    sbt, h = b * _split(s, tp), spec.hidden_size
    norm_n = len(layer.norms)
    terms = {"norms": norm_n * _norm_bytes(spec, sbt * h, sbt, ab) - norm_n * 4 * sbt * h}
    # Split as before: what a lean block keeps too, and HF's fp32 upcast copies (4sbh per norm) on top.
    terms["norms: HF fp32 upcast copy"] = norm_n * 4 * sbt * h
    terms |= _attention_io_terms(spec, layer.attention, b, s, ab, attention, tp)
    terms |= _qk_norm_terms(spec, layer.attention, b * s, ab, tp)
    terms |= _mlp_terms(spec, layer.mlp, b * s, ab, tp)
    terms |= _score_terms(spec, layer.attention, b, s, ab, attention, tp)
    return terms


def _attention_io_terms(
    spec: ModelSpec, at: AttentionShape, b: int, s: int, ab: int, attention: Attention, tp: int
) -> Terms:
    """What attention keeps around its kernel: the projections' input and outputs, an explicit mask, MLA's latent path,
    a rotary output copy."""
    h, sb = spec.hidden_size, s * b
    a, kv, d, dv = _split(at.num_heads, tp), _split(at.num_kv_heads, tp), at.head_dim, at.v_head_dim  # this rank's
    terms: Terms = {}
    eager = attention.keeps_scores
    # SDPA with an explicit mask (a sliding-window or chunked layer past its window): transformers repeats k and v to
    # every head (no native GQA with a mask) and torch turns the boolean mask into an additive one in the compute
    # dtype, which the kernel keeps for backward; each layer converts its own.
    masked = attention is Attention.SDPA and bool(at.window) and s > at.window
    kv_heads = a if eager or masked else kv
    if masked:
        terms["sliding-window mask (sdpa, b*s^2)"] = ab * b * s * s
    if at.mla:
        c, r, rope = at.kv_lora_rank, at.q_lora_rank, at.rope_dim
        # the block input to q_a / kv_a (one storage; under tp the gathered sequence: the latent path is replicated)
        latent = ab * sb * h
        if r:
            latent += ab * sb * r + _norm_bytes(spec, sb * r, sb, ab)  # q_a output (its norm's input), q_a norm
            latent += ab * sb * r  # q_b input (the norm's output)
        latent += ab * sb * (c + rope) + _norm_bytes(spec, sb * c, sb, ab) + ab * sb * c  # kv_a out, norm, kv_b in
        terms["attention latent (MLA)"] = latent
        terms["attention inputs/outputs"] = ab * sb * (a * d + a * d + a * dv) + ab * sb * a * dv
        return terms
    v_storage = kv_heads * dv
    if at.fused_qkv and kv_heads == kv:
        # Phi-3: v is a view of the fused qkv output, so SDPA (or eager without GQA repeats) keeps that whole
        # storage alive, not just v's share.
        v_storage = a * d + kv * d + kv * dv
    # q/k/v's shared input (under tp: all-gathered, the whole sequence), q, k, v (this rank's heads) and the
    # kernel's output (o_proj's input).
    terms["attention inputs/outputs"] = ab * sb * h + ab * sb * (a * d + kv_heads * d + v_storage) + ab * sb * a * dv
    if spec.features.rotary_output_copy and not eager:
        # Phi-3 rotates with torch.cat, which leaves q contiguous as (b, a, s, d); a fused kernel writes its
        # output in q's layout (CUDA flash: empty_like(q)), so transformers' transpose(1, 2).contiguous() copies
        # it: o_proj keeps that copy next to the kernel's own output (Llama's q stays (b, s, a, d): no copy).
        terms["attention output copy (rotary by cat)"] = ab * sb * a * dv
    return terms


def _qk_norm_terms(spec: ModelSpec, at: AttentionShape, sb: int, ab: int, tp: int) -> Terms:
    """Norms over q and k: per head (Qwen3, Gemma 3), over the projection (OLMo 2), or Llama 4's weightless L2."""
    a, kv, d = _split(at.num_heads, tp), _split(at.num_kv_heads, tp), at.head_dim
    if at.qk_norm == "proj":  # under tp the rank's columns are all-gathered and normed whole (the `proj_norm` style)
        a, kv = at.num_heads, at.num_kv_heads
    if at.qk_norm in ("head", "proj"):
        rows_q, rows_k = (sb * a, sb * kv) if at.qk_norm == "head" else (sb, sb)
        return {"q/k norms": _norm_bytes(spec, sb * a * d, rows_q, ab) + _norm_bytes(spec, sb * kv * d, rows_k, ab)}
    if at.qk_norm == "l2":
        # Llama 4's weightless L2 norm per head, x.float() * rsqrt(mean(x^2)): it keeps its fp32 input (fp32: the
        # rotary complex product itself; bf16: the upcast copy) and an fp32 rsqrt per head row. No weight: its
        # output is kept only by attention (q, k above).
        return {"q/k norms (l2)": 4 * sb * (a + kv) * d + 4 * sb * (a + kv)}
    return {}


def _mlp_terms(spec: ModelSpec, m: Mlp, sb: int, ab: int, tp: int) -> Terms:
    """The gated MLP on this rank's columns, or a mixture of experts (replicated over the tp group, run on the
    gathered sequence: its terms are sb's)."""
    h = spec.hidden_size
    if m.moe and spec.features.dense_moe:
        i, k, e = m.intermediate_size, m.experts_per_token, m.num_experts
        return {
            "mlp": ab * sb * h,  # the MoE input: router, routed copies and shared expert read it
            # Llama4Router: top-k of the logits scattered into -inf, sigmoid in fp32 (kept: E per token), the top-k
            # indices (int64, scatter's backward) and the scores in the compute dtype, transposed to (E*tokens, 1) (a
            # copy, kept by the multiply for the expert inputs' gradient).
            "moe router": sb * (4 * e + 8 * k + ab * e),
            # Llama4TextMoe runs every token through every expert, scaled by its score (0 off its top-k): the input
            # repeated E times (kept for the scores' gradient), its scaled copy (the bmm input), the gate_up output,
            # act(gate) and the product (down's input), all E x tokens rows.
            "moe experts (every token, every expert)": e * sb * ab * (2 * h + 4 * i),
            "shared expert": 4 * ab * sb * m.shared_size,
        }
    if m.moe:
        return _sparse_moe_terms(spec, m, sb, ab)
    i = _split(m.intermediate_size, tp)
    return {
        # the MLP input (under tp: all-gathered, the whole sequence; gate and up share it), gate and up outputs (for
        # act's and the product's backward) and the product (down's input): this rank's i/tp columns.
        "mlp": ab * sb * h + 3 * ab * sb * i,
        # HF's act_fn(gate) * up keeps act(gate) as its own tensor; a fused SwiGLU (Liger's, or torch.compile's
        # fusion) recomputes it from gate in backward: ab*sbi per layer more.
        "mlp: HF silu(gate) kept": ab * sb * i,
    }


def _sparse_moe_terms(spec: ModelSpec, m: Mlp, sb: int, ab: int) -> Terms:
    """transformers' grouped-mm experts: the router keeps its fp32 probabilities (E per token), the top-k indices
    (int64) and weights and their sum; then per (token, expert) pair the gathered input, the gate_up output, act(gate)
    and the product (down's input), the down output (for the routing weight's gradient), the routing weight and three
    int64 permutation indices. gpt-oss's clamped GLU keeps 3 more i-wide tensors."""
    h, i, k, e = spec.hidden_size, m.intermediate_size, m.experts_per_token, m.num_experts
    terms = {"mlp": ab * sb * h, "moe router": sb * (4 * e + 12 * k + 4)}
    if spec.features.router_fp32 and ab != 4:
        # DeepSeek-V3's router runs in fp32: its linear keeps an fp32 copy of the block's hidden states, and the
        # routing weights gathered from the fp32 sigmoid scores keep E more fp32 values per token (measured on
        # fake tensors, tests/measure/test_fake.py).
        terms["moe router fp32 input"] = 4 * sb * (h + e)
    glu = 7 if m.act == "swiglu-clamped" else 4
    terms["moe dispatched tokens"] = k * sb * (ab * (2 * h + glu * i) + 4 + 8 * (4 if m.expert_bias else 3))
    if m.shared_size:
        terms["shared expert"] = 4 * ab * sb * m.shared_size
    return terms


def _score_terms(spec: ModelSpec, at: AttentionShape, b: int, s: int, ab: int, attention: Attention, tp: int) -> Terms:
    """What the kernel keeps of the scores: eager's s^2 softmax (and soft-cap), a fused kernel's fp32 logsumexp."""
    a = _split(at.num_heads, tp)
    s2 = b * a * s * s
    if not attention.keeps_scores:
        return {"attention logsumexp": 4 * b * a * s}
    if at.sinks:
        # gpt-oss: softmax over the scores and one sink logit per row (b*a*s*(s+1), compute dtype), the row
        # max's int64 index; the AV matmul keeps a slice of the softmax output (same storage).
        terms = {"attention scores (s^2)": ab * b * a * s * (s + 1) + 8 * b * a * s}
    elif not spec.features.eager_softmax_fp32:
        # Llama 4's eager softmax runs in the compute dtype (no fp32 upcast): one s^2 tensor.
        terms = {"attention scores (s^2)": ab * s2}
    else:
        terms = {"attention scores (s^2)": (4 if ab == 4 else 4 + 2) * s2}
    if at.softcap:  # Gemma 2: tanh(scores / cap) keeps its output
        terms["attention softcap (s^2)"] = ab * s2
    return terms


BLOCK_TERMS: dict[str, Callable[[ModelSpec, Layer, int, int, int, Attention, int], Terms]] = {
    "gated": _gated_block_terms,
    "gpt2": _gpt2_block_terms,
}
"""The saved tensors of each block shape a family declares (llmctl.families.base.Features.block)."""


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
    spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, layer: Layer | None = None, tp: int = 1
) -> dict[str, int]:
    """Bytes one block saves for backward by tensor group (one rank's, under tp): the given block, else the model's
    largest. A measured model has no groups: its block's measured bytes, as one line."""
    if spec.measured is not None:
        layer = layer or largest_block(spec, b, s, act_bytes, attention)
        return {"block, measured on fake tensors": layer_activation_bytes(spec, b, s, act_bytes, attention, layer)}
    return block_activation_terms(
        spec, layer or largest_block(spec, b, s, act_bytes, attention, tp), b, s, act_bytes, attention, tp=tp
    )


def largest_block(spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, tp: int = 1) -> Layer:
    return max(
        (layer for layer, _ in spec.layer_groups),
        key=lambda la: layer_activation_bytes(spec, b, s, act_bytes, attention, la, tp=tp),
    )


def layer_activation_bytes(
    spec: ModelSpec,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    layer: Layer | None = None,
    mask_bytes: int = DROPOUT_MASK_BYTES,
    tp: int = 1,
) -> int:
    """Bytes one block saves for backward (the given one, else the first; one rank's under tp). A measured model has
    no tensor-parallel layout: its block as measured, whatever tp."""
    layer = layer or spec.layers[0]
    if spec.measured is not None:
        return measured_saved_bytes(spec, layer, b, s, act_bytes, attention, "none")
    return sum(block_activation_terms(spec, layer, b, s, act_bytes, attention, mask_bytes, tp).values())


def measured_saved_bytes(
    spec: ModelSpec, layer: Layer, b: int, s: int, act_bytes: int, attention: str, checkpointing: str
) -> int:
    """A measured model's block: a*b*s + c*b*s^2 from the fit on fake tensors (flash behaves as sdpa: both keep no
    s^2 tensor)."""
    assert spec.measured is not None
    attn = Attention.EAGER if Attention(attention).keeps_scores else Attention.SDPA
    key = f"{4 if act_bytes == 4 else 2}/{attn}/{'full' if checkpointing == 'full' else 'none'}"
    lin, quad = spec.measured["saved"][key][layer.measured_kind]
    return int(round(lin * b * s + quad * b * s * s))


def _checkpoint_input_tokens(b: int, s: int, tp: int, first: bool) -> int:
    """Tokens of a checkpointed block's input (what the checkpoint holds for its recompute): under tp this rank's
    sequence shard, but the first block's is the embedding's all-reduced output, the whole sequence (the block cuts it
    to its shard inside the checkpoint)."""
    return b * (s if first else _split(s, tp))


def selective_layer_terms(
    spec: ModelSpec,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    layer: Layer | None = None,
    tp: int = 1,
    first: bool = False,
) -> dict[str, int]:
    """Bytes one block keeps for backward under selective checkpointing (the engine's op policy): its input (the
    checkpoint's argument), the outputs of every other matmul (flops.selective_kept: q, v, gate, down in a Llama
    block; c_attn and c_fc in GPT-2's; per MoE token the router and each expert's down) and a fused attention
    kernel's output and fp32 logsumexp. Everything else is regenerated in backward. Measured exact to the byte
    (tests/plan/test_memory_checkpointing.py).

    Under tp (torch's sequence parallelism, measured by tests/engine/test_tp_activations.py): the input is this rank's
    sequence shard (the first block's: the whole sequence), a column-parallel matmul's output holds this rank's
    heads or columns, a row-parallel one's (o, down) is its partial sum over the whole sequence (the policy keeps the
    matmul's output, before the reduce-scatter), a replicated one's (router, experts) is whole, and the kernel's
    output and logsumexp hold this rank's heads."""
    layer = layer or spec.layers[0]
    sb, ab = s * b, act_bytes
    mm = [(n, o) for (n, _, o), k in zip(fl.layer_matmuls(spec, layer), fl.selective_kept(spec, layer)) if k]
    kept = sum(_split(o, tp) if n in COLWISE else o for n, o in mm)
    tokens = _checkpoint_input_tokens(b, s, tp, first)
    terms = {"block input": ab * tokens * spec.hidden_size, "kept matmul outputs": ab * sb * kept}
    if not Attention(attention).keeps_scores:
        at = layer.attention
        a = _split(at.num_heads, tp)
        terms["attention output + logsumexp"] = ab * sb * a * at.v_head_dim + 4 * b * a * s
    return terms


def layer_saved_bytes(
    spec: ModelSpec,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    checkpointing: str,
    layer: Layer | None = None,
    tp: int = 1,
    first: bool = False,
) -> int:
    """Bytes a block keeps for backward in a mode (partial:K: use stage_activation_bytes, it differs per layer); one
    rank's under tp, where the first block (`first`) checkpointed holds the whole sequence as its input. Cached per
    spec (the stage sums and the recompute buffer ask it for every micro-batch the planner tries)."""
    layer = layer or spec.layers[0]
    which = layer_kind_of(spec, layer)
    if which is None:  # not one of the spec's blocks: not cached
        return _layer_saved_bytes(spec, b, s, act_bytes, attention, checkpointing, layer, tp, first)
    key = ("layer_saved_bytes", b, s, act_bytes, attention, checkpointing, which, tp, first)
    return fl._memo(
        spec, key, lambda: _layer_saved_bytes(spec, b, s, act_bytes, attention, checkpointing, layer, tp, first)
    )


def _layer_saved_bytes(
    spec: ModelSpec,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    checkpointing: str,
    layer: Layer,
    tp: int,
    first: bool,
) -> int:
    if checkpointing == "full":
        if spec.measured is not None:  # what the checkpoint keeps, measured (the block input, or more)
            return measured_saved_bytes(spec, layer, b, s, act_bytes, attention, "full")
        return act_bytes * _checkpoint_input_tokens(b, s, tp, first) * spec.hidden_size
    if checkpointing == "selective":
        if spec.measured is not None:  # not measured: bounded by the two measured modes, take the no-checkpoint one
            return measured_saved_bytes(spec, layer, b, s, act_bytes, attention, "none")
        return sum(selective_layer_terms(spec, b, s, act_bytes, attention, layer, tp, first).values())
    return layer_activation_bytes(spec, b, s, act_bytes, attention, layer, tp=tp)


def layer_kinds(spec: ModelSpec) -> list[int]:
    """For each of the spec's blocks, the index of its first equal block (cached per spec): a key for the per-block
    sums that costs nothing to hash, where a Layer's own hash walks its whole description."""

    def kinds() -> list[int]:
        first: dict[Layer, int] = {}
        return [first.setdefault(layer, i) for i, layer in enumerate(spec.layers)]

    return fl._memo(spec, ("layer_kinds",), kinds)


def layer_kind_of(spec: ModelSpec, layer: Layer) -> int | None:
    """layer_kinds' index of one of the spec's own block objects (None for a Layer the spec does not hold)."""
    ids = fl._memo(spec, ("layer_ids",), lambda: {id(la): k for la, k in zip(spec.layers, layer_kinds(spec))})
    return ids.get(id(layer))


def stage_activation_bytes(
    spec: ModelSpec, layers: int, b: int, s: int, act_bytes: int, attention: str, checkpointing: str, tp: int = 1
) -> int:
    """Bytes `layers` consecutive blocks from the first keep for backward (partial:K checkpoints layers // K of them
    whole), one rank's under tp. Past the last block the pattern repeats (a what-if deeper stack of the same
    blocks). Cached per spec (the planner asks the same sums for every strategy and node count)."""
    key = ("stage_activation_bytes", layers, b, s, act_bytes, attention, checkpointing, tp)
    return fl._memo(
        spec, key, lambda: _stage_activation_bytes(spec, layers, b, s, act_bytes, attention, checkpointing, tp)
    )


def _stage_activation_bytes(
    spec: ModelSpec, layers: int, b: int, s: int, act_bytes: int, attention: str, checkpointing: str, tp: int
) -> int:
    blocks = [spec.layers[i % spec.num_layers] for i in range(layers)]
    if ckpt_modes.partial_every(checkpointing):
        whole = set(ckpt_modes.whole_layers(checkpointing, layers))
        # equal blocks in the same mode keep the same bytes: count them (by their kind: a Layer's hash walks it)
        kind = layer_kinds(spec)
        kinds: dict[tuple[int, str, bool], tuple[Layer, int]] = {}
        for i in range(layers):
            layer = blocks[i]
            key = (kind[i % spec.num_layers], "full" if i in whole else "none", i == 0)
            kinds[key] = (layer, kinds[key][1] + 1 if key in kinds else 1)
        return sum(
            n * layer_saved_bytes(spec, b, s, act_bytes, attention, mode, layer, tp, first)
            for (_, mode, first), (layer, n) in kinds.items()
        )
    kind = layer_kinds(spec)
    counts: dict[int, tuple[Layer, int]] = {}
    for i in range(layers):
        k = kind[i % spec.num_layers]
        counts[k] = (blocks[i], counts[k][1] + 1 if k in counts else 1)
    total = sum(
        n * layer_saved_bytes(spec, b, s, act_bytes, attention, checkpointing, la, tp) for la, n in counts.values()
    )
    if tp > 1 and checkpointing != "none" and blocks:
        # The first block checkpointed holds the whole sequence as its input, not its shard.
        first = (spec, b, s, act_bytes, attention, checkpointing, blocks[0], tp)
        total += layer_saved_bytes(*first, first=True) - layer_saved_bytes(*first)
    return total


def recompute_buffer_bytes(
    spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, checkpointing: str, tp: int = 1
) -> int:
    """Live at once while one checkpointed block's backward runs: what its recompute regenerates (the largest
    block's; one rank's under tp). A whole block (full, partial) regenerates everything it would have saved; a
    selective block the part it did not keep. Cached per spec."""
    if checkpointing == "none":
        return 0
    key = ("recompute_buffer_bytes", b, s, act_bytes, attention, checkpointing, tp)
    return fl._memo(spec, key, lambda: _recompute_buffer_bytes(spec, b, s, act_bytes, attention, checkpointing, tp))


def _recompute_buffer_bytes(
    spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, checkpointing: str, tp: int
) -> int:
    worst = 0
    for layer, _ in spec.layer_groups:
        none = layer_activation_bytes(spec, b, s, act_bytes, attention, layer, tp=tp)
        if checkpointing == "selective":
            sel = layer_saved_bytes(spec, b, s, act_bytes, attention, "selective", layer, tp)
            none = max(0, none - (sel - act_bytes * _checkpoint_input_tokens(b, s, tp, False) * spec.hidden_size))
        worst = max(worst, none)
    return worst


def shared_activation_bytes(
    spec: ModelSpec, b: int, s: int, act_bytes: int, attention: str, position_rows: int = 1
) -> int:
    """Kept once for all blocks: the attention masks and, for rotary models, the cos/sin tables (1 x s x rotary dim
    each, compute dtype: Hugging Face builds position ids of batch 1; Gemma 3 keeps a second pair for its local
    layers). Eager attention keeps its materialised causal mask (b x 1 x s x s, compute dtype; a second one when
    sliding-window and global layers mix). SDPA and flash take is_causal and build none (a sliding-window layer's
    SDPA mask is that layer's: block_activation_terms). Under tp every rank builds them from the whole sequence: the
    same bytes on each. `position_rows`: the rows of the position ids the model is given (context parallelism passes
    each sequence's own part of them, b rows: the tables are b x s x rotary dim)."""
    windows = fl._memo(
        spec, ("attention_windows",), lambda: {la.attention.window for la in spec.layers if not la.attention.chunked}
    )
    sliding = any(windows)
    # SDPA: the sliding-window layers' masks are the layers' own (block_activation_terms); flash takes the window.
    eager = Attention(attention).keeps_scores
    mask = (2 if sliding and len(windows) > 1 else 1) * act_bytes * b * s * s if eager else 0
    if not spec.features.rotary or spec.measured is not None:
        return mask
    at = spec.layers[0].attention
    rot = at.rope_dim if at.mla else at.head_dim
    if spec.features.rotary_complex:
        # Llama 4 builds a mask per layer type present (chunked, full: eager materialises each, b x 1 x s x s), and
        # its rotary table is one complex64 freqs_cis (1 x s x d/2: 4 bytes per rotary dim) whatever the dtype.
        types = len({la.attention.chunked for la in spec.layers})
        return (types * act_bytes * b * s * s if eager else 0) + 4 * position_rows * s * rot
    tables = spec.features.rotary_tables
    return mask + tables * 2 * position_rows * s * rot * act_bytes


def head_activation_bytes(spec: ModelSpec, b: int, s: int, act_bytes: int, tp: int = 1) -> int:
    """Saved by the final norm and the LM head input, plus the token ids (embedding and labels, int64). Under tp
    (one rank's): the final norm runs on this rank's s/tp tokens (SequenceParallel), the LM head keeps its
    all-gathered input (the whole sequence, b*s*h), a soft-cap keeps this rank's V/tp logit columns; the ids are
    whole on every rank."""
    sb, h = s * b, spec.hidden_size
    sbt = b * _split(s, tp)
    if spec.features.norm == "layernorm":  # input, mean, rstd
        norm = act_bytes * sbt * h + 2 * act_bytes * sbt
    else:
        norm = _norm_bytes(spec, sbt * h, sbt, act_bytes)
    # tanh keeps its output
    softcap = act_bytes * sb * _split(spec.vocab_size, tp) if spec.final_logit_softcapping else 0
    # GPT-2's embedding dropout mask: on the embedding's output, the whole sequence under tp
    embd_dropout = DROPOUT_MASK_BYTES * sb * h if spec.embd_dropout > 0 else 0
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


def stage_blocks_saved_bytes(
    spec: ModelSpec,
    blocks: range,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    checkpointing: str,
    tp: int = 1,
    input_whole: bool = False,
) -> int:
    """Bytes one pipeline stage's blocks (spec.layers[blocks]) keep for backward for one micro-batch, one rank's under
    tp. partial:K checkpoints by the stage's own block count (each stage is its own module). `input_whole`: the stage's
    first block, checkpointed, holds the whole sequence as its input (under tp the embedding's all-reduced output: the
    first stage's only; a later stage receives the sequence shard). Cached per spec."""
    key = ("stage_blocks_saved_bytes", blocks.start, blocks.stop, b, s, act_bytes, attention, checkpointing, tp)
    key += (input_whole,)
    return fl._memo(
        spec,
        key,
        lambda: _stage_blocks_saved_bytes(spec, blocks, b, s, act_bytes, attention, checkpointing, tp, input_whole),
    )


def _stage_blocks_saved_bytes(
    spec: ModelSpec,
    blocks: range,
    b: int,
    s: int,
    act_bytes: int,
    attention: str,
    checkpointing: str,
    tp: int,
    input_whole: bool,
) -> int:
    total = 0
    for i, index in enumerate(blocks):
        mode = stage_block_mode(checkpointing, len(blocks), i)
        first = input_whole and i == 0 and tp > 1 and mode != "none"
        total += layer_saved_bytes(spec, b, s, act_bytes, attention, mode, spec.layers[index], tp, first)
    return total


def stage_block_mode(checkpointing: str, num_blocks: int, i: int) -> str:
    """The checkpointing mode of a stage's i-th block: partial:K's whole-layer checkpoints counted within the stage."""
    if not ckpt_modes.partial_every(checkpointing):
        return checkpointing
    return "full" if i in set(ckpt_modes.whole_layers(checkpointing, num_blocks)) else "none"


def input_ids_bytes(spec: ModelSpec, b: int, s: int) -> int:
    """What the embedding keeps for backward: the token ids (int64), and GPT-2's embedding dropout mask (on the first
    pipeline stage; head_activation_bytes counts them with the head's at pp 1)."""
    embd_dropout = DROPOUT_MASK_BYTES * s * b * spec.hidden_size if spec.embd_dropout > 0 else 0
    return 8 * s * b + embd_dropout
