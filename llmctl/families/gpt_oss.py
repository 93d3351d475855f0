"""gpt-oss: attention sinks, biases on attention and experts (router too), a clamped SwiGLU, sliding/full layers
alternating, experts on every layer, norms that multiply by their weight in fp32, YaRN RoPE."""

from __future__ import annotations

from collections.abc import Callable

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Config, Family, Features, integer
from llmctl.families.decoder import Traits, alternate, read_gated
from llmctl.families.tiny import tiny
from llmctl.spec.layers import Mlp


def _experts(cfg: Config, act: str, width: int) -> tuple[Mlp | None, Callable[[int], bool]]:
    moe = Mlp(
        "swiglu-clamped",
        width,
        num_experts=integer(cfg, "num_local_experts", default=128),
        experts_per_token=integer(cfg, "num_experts_per_tok", "experts_per_token", default=4),
        router_bias=True,
        expert_bias=True,
        names=("router", "experts", "shared_experts"),
    )
    return moe, lambda i: True


GPT_OSS = Traits(layer_rule=alternate, attention_bias_default=True, moe=_experts, sinks=True)

FAMILIES = (
    Family(
        "gpt_oss",
        "gpt_oss",
        lambda cfg: read_gated(cfg, GPT_OSS),
        Features(norm="fp32_weight"),
        tiny(
            model_type="gpt_oss",
            num_hidden_layers=2,
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
        tp_plan=tpp.GPT_OSS,
    ),
)
