"""Tensor-parallel plans of the families (torch-free): which submodule of a decoder layer is split how, and why a
family or a shape cannot be split.

A plan maps a path inside one decoder layer to a style; llmctl.engine.tensor_parallel turns each style into torch's
own `ParallelStyle` (torchtitan's `parallelize_llama` is the model: Megatron-style tensor parallelism with sequence
parallelism, Korthikanti et al. 2022):

- `norm`: a norm whose input is the sequence-sharded residual stream (`SequenceParallel`): it runs on s/tp tokens
  and its weight's gradient is summed over the tp group.
- `norm_local`: the same for a norm whose output is added to the residual stream as a plain tensor (Gemma's
  post-attention and post-feed-forward norms).
- `head_norm`: a per-head norm on the local heads (Qwen 3 and Gemma 3's q/k norms): `SequenceParallel` on the heads
  dimension, so the weight (head_dim long) gets the gradient summed over the tp group's heads.
- `attention`: the attention block's input all-gathered from sequence shards (`PrepareModuleInput`, Shard(1) ->
  Replicate): q/k/v are `colwise` (whole heads per rank), o is `rowwise` with a reduce-scatter back to sequence
  shards.
- `mlp`: a dense gated MLP (gate and up `colwise`, down `rowwise`), or, when the layer's block is a mixture of
  experts, the whole block replicated over the tp group (its input all-gathered, its output cut back to this rank's
  sequence shard; expert parallelism is a later step).
- `mlp_pair`: `mlp` for a block whose MoE returns (hidden states, router logits) (Llama 4, gpt-oss).
- `latent_attention`: multi-head latent attention (DeepSeek-V3's MLA, as torchtitan's deepseek_v3 plan splits it):
  the block's input all-gathered and handed on as a plain tensor; the shared latent projections (q_a_proj,
  kv_a_proj_with_mqa, which also gives the shared rotary key) and their norms are not in the plan, so they stay
  replicated over the tp group and run on the whole sequence; q_b_proj / kv_b_proj are `colwise` (whole heads per
  rank), o_proj `rowwise`. The replicated weights see the whole sequence, and the gradient of a latent read only by
  a colwise projection is already summed over the group (the backward of a Replicate input's partial gradients).
- `shared_key`: the replicated projection whose last qk_rope_head_dim outputs are one rotary key shared by all heads
  (MLA's kv_a_proj_with_mqa): each rank's attention reads it for its own heads only, so the gradient of those
  columns is a partial sum over heads and is all-reduced over the tp group in the backward (identity forward).
- `head_param`: a parameter with one entry per head on the attention module itself (gpt-oss's attention sinks):
  split with the heads (Shard(0)); the module's forward sees this rank's heads' entries as a plain tensor.
- `proj_norm`: a norm over a whole colwise projection (OLMo 2's q_norm / k_norm normalise the num_heads x head_dim
  width): the projection's local columns all-gathered to the full width, normalised with the weight whole
  (replicated, like every norm), and cut back to this rank's columns. Chosen over a sharded RMSNorm (a sum of squares
  all-reduced) because it is torch's own styles and nothing else, and the variance is the same sum over the same
  row as at tp 1; it all-gathers q and k's width per layer (b x s x (heads + kv heads) x head_dim) where the sharded
  norm would all-reduce b x s numbers.

The embedding, final norm and LM head (`ROOT`) are the same for every family with a plan: the embedding split by
vocabulary rows (all-reduced to every rank: transformers builds its masks and rotary tables from the whole
sequence), the first layer's input cut to sequence shards, the final norm sequence-parallel and the LM head split by
vocabulary with its loss computed on the shards (loss parallel: no rank holds the whole b x s x V logits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from llmctl.families.base import Family


class Splittable(Protocol):
    """What a tensor-parallel split reads of a model (llmctl.spec.models.ModelSpec), named here so that the families
    do not import the spec module that asks them for their entries."""

    model_type: str
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    @property
    def family(self) -> Family | None: ...


STYLES = (
    "norm",
    "norm_local",
    "head_norm",
    "attention",
    "colwise",
    "rowwise",
    "mlp",
    "mlp_pair",
    "latent_attention",
    "shared_key",
    "head_param",
    "proj_norm",
)

_ATTENTION = {
    "self_attn": "attention",
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
}
LLAMA: Mapping[str, str] = {"input_layernorm": "norm", **_ATTENTION, "post_attention_layernorm": "norm", "mlp": "mlp"}
"""Llama, Mistral, Mixtral, Qwen 2, SmolLM 3: pre-norm blocks."""
QK_NORM: Mapping[str, str] = {**LLAMA, "self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"}
"""Qwen 3 (dense and MoE): per-head RMSNorm of q and k before rotary."""
GEMMA: Mapping[str, str] = {
    "input_layernorm": "norm",
    **_ATTENTION,
    "post_attention_layernorm": "norm_local",
    "pre_feedforward_layernorm": "norm",
    "mlp": "mlp",
    "post_feedforward_layernorm": "norm_local",
}
"""Gemma 2: sandwich norms around attention and the MLP."""
GEMMA3: Mapping[str, str] = {**GEMMA, "self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"}
LLAMA4: Mapping[str, str] = {
    "input_layernorm": "norm",
    **_ATTENTION,
    "post_attention_layernorm": "norm",
    "feed_forward": "mlp_pair",
}
"""Llama 4 text: its q/k L2 norm has no weight; feed_forward is a dense MLP or the MoE with its shared expert."""

OLMO2: Mapping[str, str] = {
    **_ATTENTION,
    "self_attn.q_norm": "proj_norm",
    "self_attn.k_norm": "proj_norm",
    "post_attention_layernorm": "norm_local",
    "mlp": "mlp",
    "post_feedforward_layernorm": "norm_local",
}
"""OLMo 2: no input norm; the attention and MLP outputs normed before the residual add; q/k RMSNorm over all heads."""
GPT_OSS: Mapping[str, str] = {
    "input_layernorm": "norm",
    **_ATTENTION,
    "self_attn.sinks": "head_param",
    "post_attention_layernorm": "norm",
    "mlp": "mlp_pair",
}
"""gpt-oss: one learned sink logit per head, split with the heads; its MoE block returns (hidden, router scores)."""
MLA: Mapping[str, str] = {
    "input_layernorm": "norm",
    "self_attn": "latent_attention",
    "self_attn.q_proj": "colwise",  # a config without q_lora_rank: q straight from the hidden states
    "self_attn.q_b_proj": "colwise",
    "self_attn.kv_a_proj_with_mqa": "shared_key",
    "self_attn.kv_b_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "post_attention_layernorm": "norm",
    "mlp": "mlp",
}
"""DeepSeek-V3: multi-head latent attention (`latent_attention`), the first dense MLPs split, the MoE blocks
replicated (expert parallelism is its own dimension)."""
LATENT_PROJECTIONS = ("q_a_proj", "kv_a_proj_with_mqa")
"""MLA's shared latent projections: not in the plan, replicated over the tp group (as their norms)."""


def replicated(tensor: str) -> bool:
    """Whether a decoder layer's tensor (its name inside the layer) is held whole by every rank of a tp group: the
    norms and MLA's latent projections (a mixture-of-experts block, also whole, is the caller's to say)."""
    return "norm" in tensor or any(f"{p}." in tensor for p in LATENT_PROJECTIONS)


ROOT: Mapping[str, str] = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
"""Where transformers' causal LMs with a plan keep the embedding, final norm and LM head."""

# Why a family has no plan (the line the planner's and the engine's refusal shows).
FUSED_QKV = "its q, k and v are one fused projection (a column split would cut across q|k|v)"


def family_refusal(model_type: str, fam: Family | None) -> str | None:
    """Why a model_type (its family entry `fam`, None outside the families) has no tensor-parallel plan (the
    refusal's one line), or None when it has one."""
    if fam is not None and fam.tp_plan is not None:
        return None
    why = fam.tp_unsupported if fam is not None and fam.tp_unsupported else "it has no tensor-parallel plan"
    return f"{model_type} cannot use tensor parallelism: {why}"


def plan_problem(spec: Splittable, tp: int) -> str | None:
    """Why `spec` cannot be split over `tp` ranks (one line, naming the field), or None."""
    if tp <= 1:
        return None
    refusal = family_refusal(spec.model_type, spec.family)
    if refusal:
        return refusal
    checks = (
        ("num_attention_heads", spec.num_heads),
        ("num_key_value_heads", spec.num_kv_heads),
        ("intermediate_size", spec.intermediate_size),
    )
    for name, v in checks:
        if v % tp:
            return f"tp {tp} does not divide {spec.model_type}'s {name} {v} (each rank holds whole heads and columns)"
    return None


def valid_tp(spec: Splittable, gpus_per_node: int, candidates: tuple[int, ...] = (1, 2, 4, 8)) -> list[int]:
    """The tp degrees the planner considers: within one node (tp divides its GPUs) and splittable for `spec`."""
    return [t for t in candidates if gpus_per_node % t == 0 and plan_problem(spec, t) is None]
