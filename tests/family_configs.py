"""Configs of Hugging Face model types for the tests.

The analytical families' tiny configs are the registry's (the `tiny` of each module under llmctl/families/, one set
for every test): `tiny` copies one, `MOE` names the ones with expert layers. A test that needs a field changed (a
longer sequence than the 128 positions, another vocabulary) passes it to `tiny` and says why where it does.

The measured types below are outside the analytical families (measured on fake tensors): the tests' own."""

from __future__ import annotations

import copy
from typing import Any

from llmctl.families import REGISTRY
from llmctl.spec.models import from_hf_config


def tiny(model_type: str, **over: Any) -> dict[str, Any]:
    """A deep copy of the registry's tiny config of `model_type` (its nested lists and dicts too: a test may change
    them) with `over` set."""
    return {**copy.deepcopy(REGISTRY[model_type].tiny), **over}


MOE: tuple[str, ...] = tuple(
    mt for mt in REGISTRY if any(layer.mlp.moe for layer in from_hf_config(tiny(mt), name=mt).layers)
)
"""The analytical model types whose tiny config has expert layers (3-D expert parameters, routers)."""


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


LLAMA_256: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 320,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
"""A small Llama whose shards cross torchao's 8-bit thresholds (4,096 values, 256-value blocks) at 1, 3 and 8 ranks:
the optimizer-state tests' model."""
