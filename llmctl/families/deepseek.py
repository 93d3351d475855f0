"""DeepSeek-V3 / R1 (and Kimi K2): multi-head latent attention (MLA); the first blocks dense, the rest routed experts
plus shared experts, with an fp32 router (DeepSeek-V3 technical report, arXiv:2412.19437, section 2)."""

from __future__ import annotations

from typing import Any

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Config, Family, Features, flag, get, headline, integer, layer_count
from llmctl.families.tiny import tiny
from llmctl.spec.layers import Attention, Layer, Mlp


def read(cfg: Config) -> dict[str, Any]:
    """DeepSeek-V3 / R1 (and Kimi K2): multi-head latent attention; the first `first_k_dense_replace` blocks dense,
    the rest routed experts plus shared experts (DeepSeek-V3 technical report, arXiv:2412.19437, section 2)."""
    h, heads, n = (
        integer(cfg, "hidden_size"),
        integer(cfg, "num_attention_heads"),
        layer_count(cfg, "num_hidden_layers"),
    )
    nope, rope = integer(cfg, "qk_nope_head_dim", default=128), integer(cfg, "qk_rope_head_dim", default=64)
    dv = integer(cfg, "v_head_dim", default=128)
    q_rank = get(cfg, "q_lora_rank", default=None) if "q_lora_rank" in cfg else 1536
    bias = flag(cfg, "attention_bias")
    attn = Attention(
        heads,
        heads,
        nope + rope,
        dv,
        qkv_bias=bias,
        o_bias=bias,
        q_lora_rank=int(q_rank or 0),
        kv_lora_rank=integer(cfg, "kv_lora_rank", default=512),
        rope_dim=rope,
    )
    moe_i = integer(cfg, "moe_intermediate_size", default=2048)
    moe = Mlp(
        "swiglu",
        moe_i,
        num_experts=integer(cfg, "n_routed_experts", default=256),
        experts_per_token=integer(cfg, "num_experts_per_tok", default=8),
        shared_size=moe_i * integer(cfg, "n_shared_experts", default=1),
    )
    dense = Mlp("swiglu", integer(cfg, "intermediate_size", default=18432))
    first = integer(cfg, "first_k_dense_replace", default=3)
    layers = tuple(Layer(attn, dense if i < first else moe) for i in range(n))
    out = headline(cfg, h, heads, default_tie=False, default_pos=4096)
    return {**out, "num_kv_heads": heads, "layers": layers}


FAMILIES = (
    Family(
        "deepseek_v3",
        "deepseek",
        read,
        Features(router_fp32=True),
        # MLA (q_lora_rank, kv_lora_rank, rope/nope head dims), one dense layer then MoE (4 routed experts, one
        # shared, top-2, group-limited routing consistent with 4 experts), YaRN RoPE
        tiny(
            model_type="deepseek_v3",
            num_hidden_layers=2,
            num_key_value_heads=4,
            intermediate_size=128,
            moe_intermediate_size=32,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        tp_plan=tpp.MLA,
        # MLA's projections (q_a/q_b, or q_proj without a q rank; the shared latent; kv_b; o), the dense layers' and
        # the shared experts' MLPs
        lora_targets=(
            "q_a_proj",
            "q_b_proj",
            "q_proj",
            "kv_a_proj_with_mqa",
            "kv_b_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ),
    ),
)
