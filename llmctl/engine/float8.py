"""float8 training: the model's linear layers swapped for torchao's Float8Linear (dynamic scaling, tensorwise or
rowwise), before tensor parallelism, activation checkpointing, compile and FSDP2, as torchtitan's float8 converter
does (torchtitan/components/quantization/float8.py). Everything else (attention, norms, the LM head, layers whose
shape float8 kernels refuse: llmctl.spec.precision.float8_convertible) computes in the policy's compute dtype.

Under the tensorwise recipe with FSDP2 the weights are all-gathered in float8 (1 byte a parameter instead of 2) and
their scales are computed for all layers at once after each optimizer step (one all-reduce of amaxes:
`precompute_float8_dynamic_scale_for_fsdp`). torchao is the optional extra `llmctl[fp8]`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmctl.engine import ao
from llmctl.errors import InputError
from llmctl.spec.precision import PrecisionPolicy, float8_convertible

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmctl.engine")

ROUTER_NAMES = ("gate", "router")
"""The MoE router's module name in transformers' MoE models (Mixtral's block_sparse_moe.gate, Qwen3-MoE's and
DeepSeek's mlp.gate, Llama 4's and gpt-oss's router): left in bf16, as torchtitan's float8 filter leaves
`router.gate` (the routing decision is sensitive; dense MLPs' gate_proj is another name)."""


def import_torchao():  # -> module torchao.float8
    return ao.import_torchao("torchao.float8", "float8 training")


@dataclass
class Float8Conversion:
    """What the conversion did: the layers swapped, the ones left in the compute dtype (and why)."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    all_gather: bool = False

    def summary(self) -> str:
        why: dict[str, int] = {}
        for reason in self.skipped.values():
            why[reason] = why.get(reason, 0) + 1
        kept = ", ".join(f"{n} {r}" for r, n in sorted(why.items()))
        gather = "float8" if self.all_gather else "bf16"
        return f"float8 {self.recipe}: {len(self.converted)} linear layers converted ({gather} weight all-gather)" + (
            f"; kept in bf16: {kept}" if kept else ""
        )


def convert(model: torch.nn.Module, p: PrecisionPolicy, fsdp: bool) -> Float8Conversion | None:
    """Swap the model's convertible nn.Linear layers for Float8Linear per the policy's recipe (None: not a float8
    policy). Refuses a model with no convertible layer (GPT-2's projections are Conv1D, not nn.Linear)."""
    if not p.float8:
        return None
    import torch

    f8 = import_torchao()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = Float8Conversion(p.float8_recipe or "", all_gather=fsdp and p.float8_all_gather)

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(mod, torch.nn.Linear):
            return False
        if mod is head:
            out.skipped[fqn] = "LM head"
        elif fqn.rsplit(".", 1)[-1] in ROUTER_NAMES:
            out.skipped[fqn] = "MoE router"
        elif not float8_convertible(mod.in_features, mod.out_features):
            out.skipped[fqn] = "not a multiple of 16"
        else:
            out.converted.append(fqn)
            return True
        return False

    config = f8.Float8LinearConfig.from_recipe_name(p.float8_recipe)
    if out.all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    f8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if not out.converted:
        raise InputError(
            f"precision {p.name}: {type(model).__name__} has no nn.Linear layer float8 can run "
            f"({len(out.skipped)} skipped; Conv1D projections, as GPT-2's, are not converted)",
            hint="use --precision bf16-mixed",
        )
    log.info("%s", out.summary())
    return out


def scale_precompute(conv: Float8Conversion | None) -> Callable[[torch.nn.Module], None] | None:
    """What runs after each optimizer step: the float8 scales of every all-gathered weight in one all-reduce (None
    without float8 all-gather)."""
    if conv is None or not conv.all_gather:
        return None
    return import_torchao().precompute_float8_dynamic_scale_for_fsdp


def describe(model: torch.nn.Module, conv: Float8Conversion | None) -> dict[str, object] | None:
    """The start event's account of float8, read from the built model (not from what was asked): the Float8Linear
    layers, those whose FSDP2 shard all-gathers in float8, and the layers kept in the compute dtype."""
    if conv is None:
        return None
    import_torchao()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    gathered = sum(
        isinstance(getattr(m.weight, "_local_tensor", m.weight), WeightWithDynamicFloat8CastTensor) for m in layers
    )
    return {
        "recipe": conv.recipe,
        "float8_layers": len(layers),
        "float8_all_gather_layers": gathered,
        "kept": conv.skipped,
    }
