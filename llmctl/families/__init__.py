"""The model families llmctl models analytically: one module per family, one `Family` entry per Hugging Face
model_type (its config reader, the block features the memory and FLOP models read, where its decoder layers sit, a
slot for its tensor-parallel plan, and its tiny test config). Torch-free.

Every other model_type is measured on fake tensors (llmctl.measure.fake) when torch is installed. A new family is a
module here and its line in MODULES.
"""

from __future__ import annotations

from typing import Any

from llmctl.errors import SpecError
from llmctl.families import deepseek, gemma, gpt2, gpt_oss, llama, llama4, olmo, phi, qwen
from llmctl.families.base import MAX_LAYERS, Config, Family, Features

MODULES = (llama, qwen, gemma, olmo, phi, gpt_oss, llama4, deepseek, gpt2)
REGISTRY: dict[str, Family] = {f.model_type: f for m in MODULES for f in m.FAMILIES}
"""model_type -> its family entry."""
ANALYTICAL_MODEL_TYPES = sorted(REGISTRY)
DEFAULT = REGISTRY["llama"]
"""What a model without a family entry is taken to be built like (a raw parameter count's assumed shape)."""

__all__ = ["ANALYTICAL_MODEL_TYPES", "DEFAULT", "MAX_LAYERS", "REGISTRY", "Config", "Family", "Features", "family_of"]


def family_of(model_type: str) -> Family | None:
    return REGISTRY.get(model_type)


def read_family(cfg: Config, name: str) -> dict[str, Any]:
    """ModelSpec fields of an analytical family's config (raises SpecError naming the field on bad input)."""
    mt = cfg["model_type"]
    try:
        out = REGISTRY[mt].read(cfg)
    except SpecError as e:
        raise SpecError(f"{name}: {e.message}", hint=e.hint) from None
    except KeyError as e:
        raise SpecError(f"{name}: missing field {e.args[0]!r} for model_type {mt!r}") from None
    except ZeroDivisionError:  # head_dim = hidden // heads, before ModelSpec can say that heads must be positive
        raise SpecError(f"{name}: num_attention_heads (n_head) must be positive, got 0") from None
    except (TypeError, ValueError, OverflowError) as e:  # int(None), int("x"), int(float("inf")) (JSON's Infinity)
        raise SpecError(f"{name}: a size field is not an integer ({e})") from None
    return out
