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
- `mlp_pair`: `mlp` for a block whose MoE returns (hidden states, router logits) (Llama 4).

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


STYLES = ("norm", "norm_local", "head_norm", "attention", "colwise", "rowwise", "mlp", "mlp_pair")

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

ROOT: Mapping[str, str] = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
"""Where transformers' causal LMs with a plan keep the embedding, final norm and LM head."""

# Why a family has no plan (the line the planner's and the engine's refusal shows).
FUSED_QKV = "its q, k and v are one fused projection (a column split would cut across q|k|v)"
OLMO2_NORM = "its q/k norms normalise over all heads together (a split would need the whole q and k on every rank)"
MLA = (
    "multi-head latent attention's shared latent and rotary-key projections need their gradients summed over the tp "
    "group, which is not built yet"
)
SINKS = "its attention sinks are one learned logit per head, not split with the heads yet"


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
