"""Phi-3 (3.5, 4): one fused qkv_proj and one gate_up_proj, no attention biases, LongRoPE (short/long factors)."""

from __future__ import annotations

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Family, Features
from llmctl.families.decoder import Traits, read_gated
from llmctl.families.tiny import tiny

PHI3 = Traits(attention_bias="none", fused=True)

FAMILIES = (
    Family(
        "phi3",
        "phi",
        lambda cfg: read_gated(cfg, PHI3),
        Features(rotary_output_copy=True),
        tiny(
            model_type="phi3",
            num_hidden_layers=2,
            intermediate_size=128,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
                "long_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
            },
        ),
        tp_unsupported=tpp.FUSED_QKV,
        lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    ),
)
