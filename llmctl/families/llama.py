"""Llama (2, 3.x), Mistral, Mixtral and SmolLM3: the reference gated decoder (LlamaDecoderLayer), with a sliding
window on every layer when set (Mistral), sparse experts on every layer (Mixtral), or no rotary on some layers
(SmolLM3)."""

from __future__ import annotations

from collections.abc import Callable

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Config, Family, Features, integer
from llmctl.families.decoder import Rule, Traits, read_gated
from llmctl.families.tiny import tiny
from llmctl.spec.layers import Mlp


def _mixtral_moe(cfg: Config, act: str, width: int) -> tuple[Mlp | None, Callable[[int], bool]]:
    moe = Mlp(
        act,
        width,
        num_experts=integer(cfg, "num_local_experts", default=8),
        experts_per_token=integer(cfg, "num_experts_per_tok", default=2),
    )
    return moe, lambda i: True


def _full(cfg: Config) -> Rule:
    return lambda i: "full_attention"


LLAMA = Traits(mlp_bias_field=True)
MISTRAL = Traits(attention_bias="none")
MIXTRAL = Traits(attention_bias="none", moe=_mixtral_moe)
SMOLLM3 = Traits(mlp_bias_field=True, layer_rule=_full, tie_default=True)

FAMILIES = (
    Family(
        "llama",
        "llama",
        lambda cfg: read_gated(cfg, LLAMA),
        # LlamaConfig has no head_dim default other than hidden // heads: the heads split the hidden size.
        Features(heads_split_hidden=True),
        tiny(model_type="llama", num_hidden_layers=2, intermediate_size=160),
        tp_plan=tpp.LLAMA,
    ),
    Family(
        "mistral",
        "llama",
        lambda cfg: read_gated(cfg, MISTRAL),
        Features(),
        # head_dim 32 differs from hidden / heads (Mistral-Nemo: 5120 hidden, 32 heads, head_dim 128)
        tiny(model_type="mistral", num_hidden_layers=2, intermediate_size=128, head_dim=32, sliding_window=None),
        tp_plan=tpp.LLAMA,
    ),
    Family(
        "mixtral",
        "llama",
        lambda cfg: read_gated(cfg, MIXTRAL),
        Features(),
        tiny(
            model_type="mixtral", num_hidden_layers=2, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2
        ),
        tp_plan=tpp.LLAMA,
    ),
    Family(
        "smollm3",
        "llama",
        lambda cfg: read_gated(cfg, SMOLLM3),
        Features(),
        # NoPE layers (no_rope_layer_interval)
        tiny(
            model_type="smollm3",
            num_hidden_layers=4,
            intermediate_size=128,
            no_rope_layer_interval=2,
            tie_word_embeddings=True,
        ),
        tp_plan=tpp.LLAMA,
    ),
)
