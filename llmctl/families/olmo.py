"""OLMo 2: norms after attention and after the MLP (no input norm), q/k RMSNorm over the whole projection, norms that
multiply by their weight in fp32."""

from __future__ import annotations

import llmctl.families.tensor_parallel as tpp
from llmctl.families.base import Family, Features
from llmctl.families.decoder import Traits, read_gated
from llmctl.families.tiny import tiny

OLMO2 = Traits(qk_norm="proj", norms=("post_attention_layernorm", "post_feedforward_layernorm"))

FAMILIES = (
    Family(
        "olmo2",
        "olmo",
        lambda cfg: read_gated(cfg, OLMO2),
        Features(norm="fp32_weight"),
        tiny(model_type="olmo2", num_hidden_layers=2, intermediate_size=128),
        tp_plan=tpp.OLMO2,
    ),
)
