"""float8 training: the model's linear layers swapped for torchao's Float8Linear (dynamic scaling, tensorwise or
rowwise), before tensor parallelism, activation checkpointing, compile and FSDP2, as torchtitan's float8 converter
does (torchtitan/components/quantization/float8.py). Everything else (attention, norms, the LM head, layers whose
shape float8 kernels refuse: llmctl.spec.precision.float8_convertible) computes in the policy's compute dtype.

Under the tensorwise recipe with FSDP2 the weights are all-gathered in float8 (1 byte a parameter instead of 2) and
their scales are computed for all layers at once after each optimizer step (one all-reduce of amaxes:
`precompute_float8_dynamic_scale_for_fsdp`). Under tensor parallelism the converted layers take torchao's float8 TP
styles (`tp_styles`), which cast before TP's all-gather. torchao is the optional extra `llmctl[fp8]`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Iterable
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


def tensorwise(module: torch.nn.Module) -> bool:
    """Whether `module` is a Float8Linear whose input, weight and gradient casts all use one dynamic scale per tensor:
    the layers torchao's float8 TP styles take (they assume tensorwise scaling: torchao/float8/float8_tensor_parallel.py).
    Without torchao imported no Float8Linear exists, so a bf16 run never imports it here."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    if linear is None or not isinstance(module, linear.Float8Linear):
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType

    c = module.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
    return all(
        x.scaling_type is ScalingType.DYNAMIC and x.scaling_granularity is ScalingGranularity.TENSORWISE for x in casts
    )


def tp_styles() -> tuple[type, type, type]:
    """torchao's (colwise, rowwise, module-input) float8 TP styles: the same splits as torch's ColwiseParallel,
    RowwiseParallel and PrepareModuleInput, with the activation cast to float8 (its scale the amax over the whole tp
    group) before the sequence all-gather, so TP's all-gather moves 1 byte an element and a block's q, k and v (or
    gate and up) share one cast; the gradient of each output is cast to float8 on the way back. Rowwise-scaled layers
    keep torch's styles (their input all-gathered in bf16, then cast), as torchtitan's parallelize_llama does."""
    import_torchao()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def count_linear_styles(styles: Iterable[object]) -> int:
    """How many of `styles` are torchao's float8 colwise or rowwise styles (0, importing nothing, without them)."""
    if "torchao.float8.float8_tensor_parallel" not in sys.modules:
        return 0
    colwise, rowwise, _ = tp_styles()
    return sum(isinstance(st, (colwise, rowwise)) for st in styles)


def gather_as_bytes() -> None:
    """Make torchao's all-gather of a float8 activation (TP's sequence all-gather under the float8 styles) send its
    data as uint8 bytes, which gloo takes: gloo has no float8 dtype ('Invalid scalar type'), NCCL does. The same bytes
    move either way (FSDP2 all-gathers float8 weights in a uint8 buffer too); CPU runs only, once a process."""
    import torch
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    table, op = float8_ops.FLOAT8_OPS_TABLE, torch.ops._c10d_functional.all_gather_into_tensor.default
    if getattr(table[op], "as_bytes", False):
        return

    def all_gather(aten_op, args, kwargs=None):  # noqa: ANN001, ANN202 - torchao's op-table signature
        x = args[0]
        data = x._data.contiguous()
        out = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {}))
        return Float8TrainingTensor(
            out.view(data.dtype), x._scale, x._orig_dtype, x._linear_mm_config, x._gemm_input_role
        )

    all_gather.as_bytes = True  # type: ignore[attr-defined]
    table[op] = all_gather


def scale_precompute(conv: Float8Conversion | None) -> Callable[[torch.nn.Module], None] | None:
    """What runs after each optimizer step: the float8 scales of every all-gathered weight in one all-reduce (None
    without float8 all-gather)."""
    if conv is None or not conv.all_gather:
        return None
    return precompute_scales


def precompute_scales(model: torch.nn.Module) -> None:
    """torchao's `precompute_float8_dynamic_scale_for_fsdp` (the amaxes of the weights stacked, one all-reduce) once
    per device mesh of the float8 weights: under tensor parallelism a Float8Linear the plan leaves whole (MLA's
    q_a_proj, replicated over tp) is sharded over the data-parallel mesh only and the split ones over data x tp, and
    torch.stack refuses DTensors of two meshes. With one mesh (every other model) it is torchao's single call."""
    import torch
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear

    precompute = import_torchao().precompute_float8_dynamic_scale_for_fsdp
    groups: dict[object, list[torch.nn.Module]] = {}
    for m in model.modules():
        if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor):
            groups.setdefault(m.weight.device_mesh, []).append(m)
    if len(groups) <= 1:
        precompute(model)
        return
    for linears in groups.values():
        precompute(torch.nn.ModuleList(linears))


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
