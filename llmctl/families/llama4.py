"""Llama 4 (text): routed experts with one shared expert, interleaved with dense blocks; chunked attention with
L2 q/k norms on the rotary layers, full attention without rotary every fourth layer (iRoPE)."""

from __future__ import annotations

from typing import Any

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Config, Family, Features, flag, headline, integer, layer_count, layer_types
from llmctl.families.tiny import tiny
from llmctl.spec.layers import Attention, Layer, Mlp


def read(cfg: Config) -> dict[str, Any]:
    """Llama 4 text: MoE blocks (routed experts + one shared expert) interleaved with dense ones (Maverick), chunked
    attention on the rotary layers and full attention without rotary every fourth layer (iRoPE)."""
    h, heads, n = (
        integer(cfg, "hidden_size"),
        integer(cfg, "num_attention_heads"),
        layer_count(cfg, "num_hidden_layers"),
    )
    d = integer(cfg, "head_dim", default=h // heads)
    kv = integer(cfg, "num_key_value_heads", default=heads)
    step = integer(cfg, "interleave_moe_layer_step", default=1)
    moe_layers = cfg.get("moe_layers")
    moe_set = set(moe_layers) if isinstance(moe_layers, list) else set(range(step - 1, n, step)) if step > 0 else set()
    nope = cfg.get("no_rope_layers")
    if not (isinstance(nope, list) and len(nope) == n):
        nope = [int((i + 1) % 4 != 0) for i in range(n)]  # Llama4TextConfig: 1 = rotary layer
    chunk = integer(cfg, "attention_chunk_size", default=8192)
    types = layer_types(cfg, n, lambda i: "chunked_attention" if nope[i] else "full_attention")
    bias, qk_l2 = flag(cfg, "attention_bias"), flag(cfg, "use_qk_norm", True)
    i_exp = integer(cfg, "intermediate_size")
    moe = Mlp(
        "swiglu",
        i_exp,
        num_experts=integer(cfg, "num_local_experts", default=16),
        experts_per_token=integer(cfg, "num_experts_per_tok", default=1),
        shared_size=i_exp,
        names=("router", "experts", "shared_expert"),
    )
    dense = Mlp("swiglu", integer(cfg, "intermediate_size_mlp", default=16384))
    layers = []
    for i in range(n):
        chunked = types[i] == "chunked_attention"
        attn = Attention(
            heads,
            kv,
            d,
            d,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="l2" if qk_l2 and nope[i] else "none",
            window=chunk if chunked else 0,
            chunked=chunked,
        )
        layers.append(Layer(attn, moe if i in moe_set else dense))
    return {**headline(cfg, h, heads, default_tie=False, default_pos=131072), "layers": tuple(layers)}


FAMILIES = (
    Family(
        "llama4_text",
        "llama4",
        read,
        # Llama4TextMoe runs every token through every expert; its eager softmax stays in the compute dtype;
        # transformers declares no flash-attention path (Llama4PreTrainedModel._supports_flash_attn = False).
        Features(dense_moe=True, eager_softmax_fp32=False, flash_attention=False, rotary_complex=True),
        # MoE every 2nd layer, NoPE every 4th, chunked attention (chunk 16), Llama 3 RoPE scaling
        tiny(
            model_type="llama4_text",
            num_hidden_layers=4,
            intermediate_size=32,
            intermediate_size_mlp=128,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=4,
            attention_chunk_size=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        tp_plan=tpp.LLAMA4,
    ),
)
