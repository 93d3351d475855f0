"""One tiny config per analytical family (2-4 blocks, small widths, few experts), shared by the tests that measure
activations against autograd and train each family with the engine. Each keeps its family's distinguishing
features: explicit head_dim, q/k norms, biases, GeGLU, extra norms, sliding/global layers, sinks, MoE layouts, MLA."""

from __future__ import annotations

from typing import Any

COMMON: dict[str, Any] = {"vocab_size": 256, "max_position_embeddings": 512, "tie_word_embeddings": False}

TINY: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 160,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    },
    "gemma2": {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 16,
        "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "olmo2": {
        "model_type": "olmo2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
    "phi3": {
        "model_type": "phi3",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 160,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "hidden_size": 64,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "llama4_text": {
        "model_type": "llama4_text",
        "hidden_size": 64,
        "intermediate_size": 48,
        "intermediate_size_mlp": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 32,
        "no_rope_layers": [1, 1, 1, 0],
    },
    "smollm3": {
        "model_type": "smollm3",
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "no_rope_layers": [1, 1, 1, 0],
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": None,
    },
    "mixtral": {
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256, "n_positions": 512},
}
"""model_type -> tiny config (COMMON merged in by `tiny`). GPT-2 keeps its default dropout (0.1)."""


def tiny(model_type: str, **over: Any) -> dict[str, Any]:
    cfg = dict(TINY[model_type])
    if model_type != "gpt2":
        cfg = {**COMMON, **cfg}
    cfg.update(over)
    return cfg


# --- measured types: outside the analytical families, measured on fake tensors (llmctl.measure.fake) ------------------
TOKENS: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    **TOKENS,
}
"""The widths the measured configs share (positions up to 2048: the fit measures at several sequence lengths)."""

OTHERS: list[dict[str, Any]] = [
    {
        "model_type": "granite",
        **SMALL,
        "num_hidden_layers": 2,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.2,
    },
    {"model_type": "cohere2", **SMALL, "num_hidden_layers": 4, "sliding_window": 128, "sliding_window_pattern": 4},
    {"model_type": "exaone4", **SMALL, "num_hidden_layers": 4, "sliding_window": 128, "sliding_window_pattern": 4},
]
"""Architectures outside the analytical families: granite (embedding/residual/logit multipliers), cohere2 (parallel
attention + MLP, LayerNorm, 3 sliding-window layers then a global one), exaone4 (post-norms, q/k norms, the same
sliding/global pattern): measured only, never described."""

KINDS: dict[str, dict[str, list[int]]] = {
    "granite": {"GraniteDecoderLayer": [0, 1]},
    "cohere2": {"Cohere2DecoderLayer/sliding_attention": [0, 1, 2], "Cohere2DecoderLayer/full_attention": [3]},
    "exaone4": {"Exaone4DecoderLayer/sliding_attention": [0, 1, 2], "Exaone4DecoderLayer/full_attention": [3]},
}
"""model_type of OTHERS -> the decoder-layer kinds the measurement finds and the layer indices of each."""

OTHER_MOE: dict[str, Any] = {
    "model_type": "granitemoe",
    **SMALL,
    "intermediate_size": 32,  # each expert's
    "num_hidden_layers": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}
"""An MoE type outside the analytical families (every layer 4 experts, top-2): fewer parameters per token than in
total."""
