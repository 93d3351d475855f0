"""Qwen2, Qwen3 and Qwen3-MoE: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), sliding attention only with
use_sliding_window from max_window_layers on, and sparse experts every decoder_sparse_step layers except
mlp_only_layers (Qwen3-MoE)."""

from __future__ import annotations

from collections.abc import Callable

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Config, Family, Features, flag, integer
from llmctl.families.decoder import Rule, Traits, read_gated
from llmctl.families.tiny import tiny
from llmctl.spec.layers import Mlp


def _qwen_rule(cfg: Config) -> Rule:
    """Qwen2/Qwen3: sliding attention only with use_sliding_window, on layers from max_window_layers on."""
    use, first = flag(cfg, "use_sliding_window"), integer(cfg, "max_window_layers", default=28)
    return lambda i: "sliding_attention" if use and cfg.get("sliding_window") and i >= first else "full_attention"


def _qwen3_moe(cfg: Config, act: str, width: int) -> tuple[Mlp | None, Callable[[int], bool]]:
    e = integer(cfg, "num_experts", "num_local_experts", default=128)
    step, only = integer(cfg, "decoder_sparse_step", default=1), set(cfg.get("mlp_only_layers") or [])
    moe = Mlp(
        act,
        integer(cfg, "moe_intermediate_size", default=768),
        num_experts=e,
        experts_per_token=integer(cfg, "num_experts_per_tok", default=8),
    )
    return moe, lambda i: i not in only and e > 0 and step > 0 and (i + 1) % step == 0


# Qwen2Attention: q/k/v bias=True, o_proj bias=False.
QWEN2 = Traits(layer_rule=_qwen_rule, attention_bias="qkv_only")
QWEN3 = Traits(layer_rule=_qwen_rule, qk_norm="head")
QWEN3_MOE = Traits(layer_rule=_qwen_rule, qk_norm="head", moe=_qwen3_moe)

FAMILIES = (
    Family(
        "qwen2",
        "qwen",
        lambda cfg: read_gated(cfg, QWEN2),
        Features(),
        tiny(model_type="qwen2", num_hidden_layers=2, intermediate_size=128),
        tp_plan=tpp.LLAMA,
    ),
    Family(
        "qwen3",
        "qwen",
        lambda cfg: read_gated(cfg, QWEN3),
        Features(),
        # q/k RMSNorm per head, explicit head_dim
        tiny(model_type="qwen3", num_hidden_layers=2, intermediate_size=128, head_dim=16, tie_word_embeddings=True),
        tp_plan=tpp.QK_NORM,
    ),
    Family(
        "qwen3_moe",
        "qwen",
        lambda cfg: read_gated(cfg, QWEN3_MOE),
        Features(),
        # one dense layer (mlp_only_layers) and one MoE layer, 3-D expert parameters
        tiny(
            model_type="qwen3_moe",
            num_hidden_layers=2,
            intermediate_size=128,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        ),
        tp_plan=tpp.QK_NORM,
    ),
)
