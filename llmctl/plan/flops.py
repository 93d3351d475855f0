"""FLOPs per token and the throughput metrics built on them (torch-free). Shared by the planner and the engine.

Conventions (stated once, used everywhere):
- Model FLOPs per token = 6 * N_matmul + 12 * L * (a * d) * s  (PaLM, Chowdhery et al. 2022, appendix B:
  6N for the forward+backward matmuls, 12*L*H*Q*T for the attention scores and values). N_matmul counts every
  weight that takes part in a matmul: all parameters but the input embedding lookup (the LM head counts; a
  tied embedding is the LM head and counts once). MoE counts only the routed experts.
- Hardware FLOPs add the recomputation (recompute_flops_per_token), derived from what each checkpointing mode
  (llmctl.spec.checkpointing) re-runs: full re-runs every block's forward (its matmuls and the attention scores:
  about 8N instead of 6N, Narayanan et al. 2021 eq. 3, but not the LM head, which no mode checkpoints); partial:K the
  forward of L // K blocks; selective only the matmuls whose outputs it does not keep (every other one, and the
  attention scores when the attention is not a fused kernel whose output is kept); the chunked loss re-runs the LM
  head's forward matmul.
- MFU = model FLOPs per second per device / device peak (PaLM's definition: recompute does not count), with the
  attention counted as the kernels run it: a causal mask leaves half the score matrix uncomputed (FlashAttention-2
  skips the blocks above the diagonal; Dao 2023 counts causal attention's FLOPs as half the full matrix's, as the
  kernel tables here do), so `mfu` counts 6N + attention / 2 (CAUSAL_MFU). PaLM and torchtitan count attention whole
  (12 L H Q T); that figure, `mfu_palm` (PALM_MFU), is what published MFU is quoted in: it is kept beside for
  comparing. The two differ by the attention's share: a fifth of the FLOPs of an 8B model at 8k tokens, over half at
  128k. The peak is the compute dtype's: bf16's for float8 runs too, whose converted linears run at the fp8 peak
  (torchtitan reports float8 runs' MFU against the bf16 peak), so a float8 run's MFU shows its speed-up over the bf16
  one.
- LoRA / QLoRA (llmctl.spec.finetune): the frozen base runs its forward (2 N_matmul per token) and, in backward, only
  the input gradients (2 N_matmul: a frozen weight gets no gradient, Hu et al. 2021 arXiv:2106.09685 section 4.2), the
  adapters their forward and both gradients (6 x adapter parameters), attention unchanged: 4 N_matmul + 6 N_adapter +
  attention, about 2/3 of full training's for a dense model. MFU under adapters counts these, the FLOPs the method
  needs (`method_flops_per_token`), not full training's 6N: a LoRA run at the same speed has a lower MFU, and MFU
  compares how well the hardware is used, not methods (tokens/s does that). Full training's MFU is unchanged.
- Context parallelism (cp ranks share one sequence, ring attention): each rank runs the matmuls of its S/cp tokens and
  1/cp of the sequence's attention with the head-tail load balance, or the last rank's larger share without it
  (llmctl.spec.parallel.ParallelDims.attention_imbalance); per-token attention still spans the whole sequence (its
  keys come round the ring).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.attention import Attention
from llmctl.spec.finetune import Finetune, adapter_params
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec

CAUSAL_MFU = "causal attention counted half (the FLOPs the kernels run)"
"""What `mfu` counts (the module docstring): the planner's, the engine's and plan.yaml's `mfu`."""
PALM_MFU = "attention counted whole (PaLM, torchtitan: the convention published MFU uses)"
"""What `mfu_palm` counts: for comparing with published MFU."""


def matmul_params(spec: ModelSpec) -> int:
    """Parameters that take part in matmuls for one token (see module docstring)."""
    n = spec.active_params_per_token - spec.embedding_params
    if spec.tie_embeddings:
        n += spec.vocab_size * spec.hidden_size  # the tied matrix is used as the LM head
    return n


def attention_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    """QK^T and AV, forward (2 matmuls x 2 FLOPs) + backward (x2), summed over blocks: 6 * a * span * (d_qk + d_v)
    per block, which is PaLM's 12 * a * d * s for full attention with equal widths; a sliding window or an attention
    chunk shortens the span (Attention.span), MLA's value heads are narrower than its query/key heads."""
    return _memo(spec, ("attention", seq_len), lambda: _attention_flops(spec, seq_len))


def _attention_flops(spec: ModelSpec, seq_len: int) -> int:
    if spec.measured is not None:
        return 12 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len
    total = 0.0
    for layer, n in spec.layer_groups:
        at = layer.attention
        total += n * 6 * at.num_heads * at.span(seq_len) * (at.head_dim + at.v_head_dim)
    return int(round(total))


def recompute_attention_flops_per_token(
    spec: ModelSpec, seq_len: int, checkpointing: str = "none", attention: str = "sdpa"
) -> int:
    """Of recompute_flops_per_token, the attention scores and values (QK^T and AV, forward) that checkpointing re-runs:
    every whole-checkpointed block's, and under selective only eager attention's (a fused kernel's output is kept)."""
    if checkpointing == "none":
        return 0
    key = ("recompute_attention", seq_len, checkpointing, Attention(attention).keeps_scores)
    return _memo(spec, key, lambda: _recompute_attention(spec, seq_len, checkpointing, attention))


def _recompute_attention(spec: ModelSpec, seq_len: int, checkpointing: str, attention: str) -> int:
    def attn_fwd(layer: Layer) -> float:  # as _recompute_flops
        at = layer.attention
        return 2 * at.num_heads * at.span(seq_len) * (at.head_dim + at.v_head_dim)

    if checkpointing == "selective":
        eager = Attention(attention).keeps_scores
        return int(round(sum(n * attn_fwd(la) for la, n in spec.layer_groups))) if eager else 0
    return int(round(sum(attn_fwd(spec.layers[i]) for i in ckpt_modes.whole_layers(checkpointing, spec.num_layers))))


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    return 6 * matmul_params(spec) + attention_flops_per_token(spec, seq_len)


def method_flops_per_token(
    spec: ModelSpec, seq_len: int, finetune: Finetune | None = None, causal: bool = False
) -> tuple[int, int]:
    """(forward, backward) model FLOPs per token of the training method (module docstring): full training's 6N +
    attention split 1:2, or with adapters 2N + 2 N_adapter + attention/3 forward, 2N + 4 N_adapter + 2/3 attention
    backward (the frozen weights' gradients not computed; the first block's input gradient, which nothing needs, is
    counted: 2 of its q/k/v/gate/up FLOPs, under 1/L). `causal`: the attention as the kernels run it, half (CAUSAL_MFU);
    else whole, as PaLM counts it."""
    n, attn = matmul_params(spec), attention_flops_per_token(spec, seq_len)
    if causal:
        attn //= 2
    if finetune is None or not finetune.adapters:
        model = 6 * n + attn
        return model // 3, model - model // 3
    p = adapter_count(spec, finetune)
    return 2 * n + 2 * p + attn // 3, 2 * n + 4 * p + attn - attn // 3


def adapter_count(spec: ModelSpec, finetune: Finetune) -> int:
    """llmctl.spec.finetune.adapter_params, cached per spec (the planner asks for every candidate)."""
    return _memo(spec, ("adapter_params", finetune), lambda: adapter_params(spec, finetune))


def adapter_recompute_flops_per_token(spec: ModelSpec, checkpointing: str, finetune: Finetune | None) -> int:
    """The adapters' forward that checkpointing re-runs beside the block's (recompute_flops_per_token): 2 x adapter
    parameters per whole-checkpointed block, half of them under selective (every other matmul)."""
    if finetune is None or not finetune.adapters or checkpointing == "none":
        return 0
    per_layer = 2 * adapter_count(spec, finetune) / spec.num_layers
    if checkpointing == "selective":
        return int(round(spec.num_layers * per_layer / 2))
    return int(round(len(ckpt_modes.whole_layers(checkpointing, spec.num_layers)) * per_layer))


def layer_matmuls(spec: ModelSpec, layer: Layer | None = None) -> list[tuple[str, int, int]]:
    """(name, input features, output features) of the matmuls one token goes through in one block (the first by
    default), in the order the block runs them (Hugging Face's LlamaDecoderLayer / MixtralSparseMoeBlock /
    GPT2Block / DeepseekV3Attention). An MoE token runs the router, then for each of its k experts gate_up and down
    (the experts loop over their tokens), then the shared expert."""
    layer = layer or spec.layers[0]
    if spec.features.conv1d:  # GPT2Block's Conv1D projections: q, k and v in one c_attn
        h, i = spec.hidden_size, layer.mlp.intermediate_size
        return [("c_attn", h, 3 * h), ("attn.c_proj", h, h), ("c_fc", h, i), ("mlp.c_proj", i, h)]
    if spec.measured is not None:  # no layout: one matmul of the matmul parameters a token passes through
        entry = spec._measured_layer(layer)
        active = entry.get("active_matmul_params", entry["matmul_params"])
        return [("block", spec.hidden_size, max(1, active // spec.hidden_size))]
    return layer.matmuls(spec.hidden_size)


def selective_kept(spec: ModelSpec, layer: Layer | None = None) -> list[bool]:
    """Per layer_matmuls entry: whether selective checkpointing keeps its output (the 1st, 3rd, 5th... matmul: the
    engine's policy, llmctl.engine.parallelize._sac_context_fn)."""
    return [n % 2 == 0 for n in range(len(layer_matmuls(spec, layer)))]


_MEMO: dict[int, tuple[ModelSpec, dict[tuple, Any]]] = {}


def _memo(spec: ModelSpec, key: tuple, fn: Callable[[], Any]) -> Any:
    """fn() cached per spec object (specs are frozen) and key: the planner asks the same per-layer sums thousands of
    times. The entry holds the spec itself, so an id is never reused while its entry lives."""
    entry = _MEMO.get(id(spec))
    if entry is None or entry[0] is not spec:
        if len(_MEMO) >= 16:
            _MEMO.clear()
        entry = _MEMO[id(spec)] = (spec, {})
    cache = entry[1]
    if key not in cache:
        cache[key] = fn()
    return cache[key]


def recompute_flops_per_token(
    spec: ModelSpec, seq_len: int, checkpointing: str = "none", attention: str = "sdpa", loss_chunked: bool = False
) -> int:
    """FLOPs re-run in backward per token (see the module docstring)."""
    key = ("recompute", seq_len, checkpointing, attention, loss_chunked)
    return _memo(spec, key, lambda: _recompute_flops(spec, seq_len, checkpointing, attention, loss_chunked))


def _recompute_flops(spec: ModelSpec, seq_len: int, checkpointing: str, attention: str, loss_chunked: bool) -> int:
    extra = 2 * spec.vocab_size * spec.hidden_size if loss_chunked else 0
    if checkpointing == "none":
        return extra

    def attn_fwd(layer: Layer) -> float:  # QK^T and AV forward: a third of attention_flops_per_token's share
        at = layer.attention
        return 2 * at.num_heads * at.span(seq_len) * (at.head_dim + at.v_head_dim)

    def layer_fwd(layer: Layer) -> int:
        return 2 * sum(i * o for _, i, o in layer_matmuls(spec, layer))

    if checkpointing == "selective":
        total = 0.0
        for layer, n in spec.layer_groups:
            mm = layer_matmuls(spec, layer)
            again = sum(2 * i * o for (_, i, o), kept in zip(mm, selective_kept(spec, layer)) if not kept)
            # A fused kernel's output (SDPA, flash) is kept; eager attention's matmuls are recomputed.
            total += n * (again + (attn_fwd(layer) if Attention(attention).keeps_scores else 0))
        return int(round(total)) + extra
    whole = ckpt_modes.whole_layers(checkpointing, spec.num_layers)
    return int(round(sum(layer_fwd(spec.layers[i]) + attn_fwd(spec.layers[i]) for i in whole))) + extra


def tp_replicated_flops_per_token(
    spec: ModelSpec, seq_len: int, checkpointing: str = "none", attention: str = "sdpa"
) -> tuple[int, int]:
    """(model, recompute) FLOPs per token of what a tensor-parallel group does not split: its mixture-of-experts blocks,
    which every rank of the group runs whole on the whole sequence (llmctl.families.tensor_parallel, the `mlp` style
    of an MoE layer). Attention, dense MLPs and the LM head are split over the tp ranks; a model measured on fake
    tensors has no tensor-parallel plan. Model FLOPs: 3 x the forward (forward + backward), as 6N is 3 x 2N."""
    if spec.measured is not None:
        return 0, 0
    key = ("tp_replicated", seq_len, checkpointing, attention)
    return _memo(spec, key, lambda: _tp_replicated(spec, checkpointing))


def _tp_replicated(spec: ModelSpec, checkpointing: str) -> tuple[int, int]:
    h = spec.hidden_size

    def moe_fwd(layer: Layer) -> int:
        return 2 * sum(i * o for _, i, o in layer.mlp.matmuls(h)) if layer.mlp.moe else 0

    model = sum(n * 3 * moe_fwd(layer) for layer, n in spec.layer_groups)
    if checkpointing == "none" or model == 0:
        return model, 0
    if checkpointing == "selective":
        again = 0
        for layer, n in spec.layer_groups:
            if not layer.mlp.moe:
                continue
            first = len(layer.attention.matmuls(h))  # layer_matmuls lists attention's projections, then the MLP's
            mm, kept = layer_matmuls(spec, layer), selective_kept(spec, layer)
            again += n * sum(2 * i * o for k, ((_, i, o), keep) in enumerate(zip(mm, kept)) if k >= first and not keep)
        return model, again
    whole = ckpt_modes.whole_layers(checkpointing, spec.num_layers)
    return model, sum(moe_fwd(spec.layers[i]) for i in whole)


def hardware_flops_per_token(
    spec: ModelSpec, seq_len: int, checkpointing: str = "none", attention: str = "sdpa", loss_chunked: bool = False
) -> int:
    """FLOPs the device really executes: the model's FLOPs plus what checkpointing and the chunked loss re-run."""
    return model_flops_per_token(spec, seq_len) + recompute_flops_per_token(
        spec, seq_len, checkpointing, attention, loss_chunked
    )


def tflops_per_device(flops_per_token: float, tokens_per_s_per_device: float) -> float:
    return flops_per_token * tokens_per_s_per_device / 1e12


def mfu(
    spec: ModelSpec,
    seq_len: int,
    tokens_per_s_per_device: float,
    peak_tflops: float,
    finetune: Finetune | None = None,
    causal: bool = True,
) -> float:
    """Model FLOPs utilisation in [0, 1]; with adapters against the FLOPs the method needs; causal attention counted
    half (CAUSAL_MFU), or with causal=False whole (PALM_MFU) (module docstring)."""
    if peak_tflops <= 0:
        return 0.0
    flops = sum(method_flops_per_token(spec, seq_len, finetune, causal))
    return tflops_per_device(flops, tokens_per_s_per_device) / peak_tflops
