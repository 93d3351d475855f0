"""Which models context parallelism can split (torch-free): the refusals the plan file, the planner and the engine
share.

Context parallelism (llmctl.engine.context_parallel) runs ring attention: each rank keeps the queries of its part of
the sequence and the keys/values go round the cp group; each step's partial attention is merged through its
log-sum-exp (torch.distributed.tensor.experimental, the algorithm of Liu et al. 2023, "Ring Attention with Blockwise
Transformers"). What torch's ring computes is plain causal attention over the whole sequence, on SDPA's kernels, so a
layer whose attention is anything else cannot be split: sliding windows and chunked attention (another mask), sinks
(an extra logit per head in every softmax), soft-capped scores (no SDPA kernel), and value heads of another width
than the queries' (multi-head latent attention: SDPA's fused CPU and GPU kernels want one head size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmctl.spec.models import ModelSpec


def cp_problem(spec: ModelSpec, seq_len: int) -> str | None:
    """Why `spec`'s attention cannot run as ring attention at `seq_len` tokens (one line naming the feature), or
    None."""
    for i, layer in enumerate(spec.layers):
        a = layer.attention
        why = ""
        if a.sinks:
            why = "attention sinks (a learned logit in every softmax, which the ring's merge does not carry)"
        elif a.softcap:
            why = "soft-capped attention scores (no SDPA kernel, so no ring attention)"
        elif a.chunked:
            why = "chunked attention (a block-diagonal mask, not causal)"
        elif a.window and a.window < seq_len:
            why = f"a sliding window of {a.window} tokens, shorter than the sequence (the ring computes full causal)"
        elif a.v_head_dim != a.head_dim:
            why = f"value heads of {a.v_head_dim} against query/key heads of {a.head_dim} (latent attention)"
        if why:
            return f"{spec.model_type} cannot use context parallelism: layer {i} has {why}"
    if spec.attention_dropout > 0:
        return (
            f"{spec.model_type} cannot use context parallelism with attention dropout {spec.attention_dropout:g} "
            "(set the config's attention dropout to 0 in model.overrides)"
        )
    return None
