"""Tiny Hugging Face configs, one per model family the engine trains: 2-4 layers, hidden 64, vocabulary 300, 4
experts with top-2 routing. Each keeps what makes its family differ from Llama (the point of testing it):

- qwen3: q/k RMSNorm per head, explicit head_dim.
- qwen3_moe: one dense layer (mlp_only_layers) and one MoE layer, 3-D expert parameters.
- gemma2: sliding/global alternation (window 16 < the tests' 32 tokens, so the window masks), attention and final
  logit soft-capping, the embedding scale buffer, query_pre_attn_scalar.
- gemma3_text: layer_types with a sliding window, q/k norm, per-layer-type RoPE (a linear-scaled global theta and a
  local one: two inv_freq buffers).
- olmo2: norms after attention/MLP, q/k norm over all heads.
- phi3: fused qkv / gate_up projections, LongRoPE (short/long factors).
- deepseek_v3: MLA (q_lora_rank, kv_lora_rank, rope/nope head dims), one dense layer then MoE (4 routed experts, one
  shared, top-2, group-limited routing with n_group/topk_group consistent with 4 experts), YaRN RoPE, the
  e_score_correction_bias buffer.
- gpt_oss: attention sinks, MoE with biases (router and experts), sliding/full alternation, YaRN RoPE.
- llama4_text: MoE every 2nd layer (interleave_moe_layer_step), NoPE every 4th layer, chunked attention (chunk 16),
  Llama 3 RoPE scaling.
- smollm3: NoPE layers (no_rope_layer_interval).
- mistral: explicit head_dim that differs from hidden/heads (Mistral-Nemo: 5120 hidden, 32 heads, head_dim 128).

Token ids (pad/bos/eos) are set inside the vocabulary: several families default to ids past 300, and a padding id
past the vocabulary fails nn.Embedding.
"""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 300,  # the byte tokenizer (256 bytes, BOS 256, EOS 257); the engine pads it to 320
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": None,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "tie_word_embeddings": False,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],  # layer 0 dense, layer 1 MoE
    },
    "gemma2": {
        **_COMMON,
        "model_type": "gemma2",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    },
    "olmo2": {
        **_COMMON,
        "model_type": "olmo2",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
    },
    "phi3": {
        **_COMMON,
        "model_type": "phi3",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "original_max_position_embeddings": 64,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10_000.0,
            # head_dim 16: 8 factors each (one per rotary frequency)
            "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
            "long_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
        },
    },
    "deepseek_v3": {
        **_COMMON,
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "first_k_dense_replace": 1,  # layer 0 dense, layer 1 MoE
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        # Group-limited routing: the experts are viewed as (n_group, experts // n_group) and each group is scored by
        # its top-2 experts, so experts // n_group must be >= 2; the default n_group 8 fails with 4 experts.
        "n_group": 2,
        "topk_group": 1,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    "gpt_oss": {
        **_COMMON,
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    },
    "llama4_text": {
        **_COMMON,
        "model_type": "llama4_text",
        "num_hidden_layers": 4,
        "intermediate_size": 32,  # the experts' size
        "intermediate_size_mlp": 128,  # the dense layers' size
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "interleave_moe_layer_step": 2,  # layers 1 and 3 MoE
        "no_rope_layer_interval": 4,  # layer 3 without RoPE (full attention), 0-2 chunked attention
        "attention_chunk_size": 16,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "smollm3": {
        **_COMMON,
        "model_type": "smollm3",
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "no_rope_layer_interval": 2,
        "tie_word_embeddings": True,
    },
    "mistral": {
        **_COMMON,
        "model_type": "mistral",
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "head_dim": 32,  # != hidden / heads (16), as in Mistral-Nemo
        "sliding_window": None,
    },
}

MOE = ("qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text")
"""The families with expert layers (3-D expert parameters, routers)."""
