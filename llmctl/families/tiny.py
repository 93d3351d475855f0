"""What every family's tiny test config shares: hidden 64, 4 heads (2 key/value), the engine's byte-level
tokenizer's vocabulary (256 bytes, BOS 256, EOS 257; the engine pads it to 320) and 128 positions."""

from __future__ import annotations

from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": None,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "tie_word_embeddings": False,
}


def tiny(**fields: Any) -> dict[str, Any]:
    """COMMON with a family's own fields (several families default their token ids past 300, and a padding id past
    the vocabulary fails nn.Embedding: each keeps them inside)."""
    return {**COMMON, **fields}
