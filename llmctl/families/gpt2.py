"""GPT-2: LayerNorms with biases, one Conv1D for q/k/v, a GELU MLP, learned positions, a tied head, dropout."""

from __future__ import annotations

from typing import Any

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Config, Family, Features, flag, get, integer, layer_count
from llmctl.spec.layers import Attention, Layer, Mlp


def read(cfg: Config) -> dict[str, Any]:
    """GPT-2: LayerNorms with biases, one c_attn (Conv1D) for q/k/v, a GELU MLP, learned positions, tied head."""
    h = integer(cfg, "n_embd", "hidden_size")
    heads, n = integer(cfg, "n_head", "num_attention_heads"), layer_count(cfg, "n_layer", "num_hidden_layers")
    d = h // heads
    attn = Attention(heads, heads, d, d, qkv_bias=True, o_bias=True, fused_qkv=True)
    layer = Layer(
        attn, Mlp("gelu", integer(cfg, "n_inner", default=4 * h), bias=True), ("ln_1", "ln_2"), norm_bias=True
    )
    return {
        "hidden_size": h,
        "num_heads": heads,
        "num_kv_heads": heads,
        "vocab_size": integer(cfg, "vocab_size"),
        "max_position_embeddings": integer(cfg, "n_positions", "max_position_embeddings", default=1024),
        "tie_embeddings": flag(cfg, "tie_word_embeddings", True),
        # GPT2Config's defaults: 0.1 each (attn_pdrop, resid_pdrop, embd_pdrop).
        "attention_dropout": float(get(cfg, "attn_pdrop", default=0.1)),
        "resid_dropout": float(get(cfg, "resid_pdrop", default=0.1)),
        "embd_dropout": float(get(cfg, "embd_pdrop", default=0.1)),
        "layers": tuple(layer for _ in range(n)),
    }


FAMILIES = (
    Family(
        "gpt2",
        "gpt2",
        read,
        Features(
            block="gpt2",
            norm="layernorm",
            rotary=False,
            heads_split_hidden=True,
            learned_positions=True,
            conv1d=True,
        ),
        {
            "model_type": "gpt2",
            "n_embd": 64,
            "n_head": 4,
            "n_layer": 2,
            "vocab_size": 300,
            "n_positions": 128,
            "bos_token_id": 256,
            "eos_token_id": 257,
        },
        decoder_path="transformer.h",
        tp_unsupported=tpp.FUSED_QKV,
        # wpe is added to inputs_embeds inside GPT2Model.forward
        pipeline_unsupported="its base model adds the learned positions in its forward (a later stage would add them "
        "again)",
        lora_targets=("c_attn", "c_proj", "c_fc"),  # Conv1D: peft adapts it with fan_in_fan_out
    ),
)
