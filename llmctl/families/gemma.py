"""Gemma 2 and Gemma 3 (text): GeGLU, pre and post feed-forward norms, `x * (1 + w)` RMSNorms in fp32, head_dim 256
by default, sliding/global layers (Gemma 2 alternating, Gemma 3 five local then one global), attention and final
logit soft-capping (Gemma 2), q/k norms and two rotary tables (Gemma 3)."""

from __future__ import annotations

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Config, Family, Features, integer
from llmctl.families.decoder import Rule, Traits, alternate, read_gated
from llmctl.families.tiny import tiny

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _gemma3_rule(cfg: Config) -> Rule:
    # Gemma 3: five local layers, then one global (sliding_window_pattern 6).
    p = integer(cfg, "sliding_window_pattern", default=6)
    return lambda i: "full_attention" if (i + 1) % p == 0 else "sliding_attention"


GEMMA2 = Traits(
    layer_rule=alternate, act="geglu", head_dim_default=256, norms=NORMS, softcap_default=30.0, tie_default=True
)
GEMMA3 = Traits(
    layer_rule=_gemma3_rule, act="geglu", head_dim_default=256, norms=NORMS, qk_norm="head", tie_default=True
)
_SLIDING = {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
"""A window of 16 under the tests' 32 tokens: the window masks."""

# Gemma{2,3}Model.forward multiplies inputs_embeds by sqrt(hidden_size) (or its embedding module does)
EMBED_SCALE = "its base model scales the embeddings in its forward (a later stage would scale its input again)"

FAMILIES = (
    Family(
        "gemma2",
        "gemma",
        lambda cfg: read_gated(cfg, GEMMA2),
        Features(norm="gemma"),
        tiny(
            model_type="gemma2",
            num_hidden_layers=2,
            intermediate_size=128,
            head_dim=16,
            query_pre_attn_scalar=16,
            pad_token_id=0,
            tie_word_embeddings=True,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            **_SLIDING,
        ),
        tp_plan=tpp.GEMMA,
        pipeline_unsupported=EMBED_SCALE,
    ),
    Family(
        "gemma3_text",
        "gemma",
        lambda cfg: read_gated(cfg, GEMMA3),
        # a local and a global rotary table (per-layer-type RoPE)
        Features(norm="gemma", rotary_tables=2),
        tiny(
            model_type="gemma3_text",
            num_hidden_layers=2,
            intermediate_size=128,
            head_dim=16,
            query_pre_attn_scalar=16,
            pad_token_id=0,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **_SLIDING,
        ),
        tp_plan=tpp.GEMMA3,
        pipeline_unsupported=EMBED_SCALE,
    ),
)
