"""QLoRA in the engine: the frozen base's block linears stored in 4-bit NormalFloat (NF4), sharded by FSDP2.

torchao's `NF4Tensor` (the QLoRA format of Dettmers et al., 2023, arXiv:2305.14314: blocks of 64 weights with one
absmax each, the absmaxes double-quantized to int8 around their mean, one scale per 256 of them where the shards
allow it: llmctl.spec.nf4.scaler_block) is the weight, and it is FSDP2-aware: `fsdp_pre_all_gather` hands FSDP2
its packed 4-bit data and scalers, so a layer's base is all-gathered in NF4 (0.52 bytes per weight) and dequantized
to the compute dtype only inside `F.linear` (torchao's `linear_nf4`, forward and backward; frozen, so no weight
gradient). This is torchtune's QLoRA path; torchao is
chosen over bitsandbytes because bitsandbytes' Params4bit is not a tensor FSDP2 can shard and all-gather in 4 bits,
and because NF4 dequantization is plain torch: it runs on a CPU rank too (so CPU tests run the real thing).

Which weights: every 2-D `nn.Linear` weight inside the decoder layers (the adapters' `base_layer` and the linears
without adapters), as bitsandbytes' `load_in_4bit` does; embeddings, norms, biases, the LM head and 3-D expert
tensors stay in the compute dtype (llmctl.plan.memory.adapters counts the same set).

How they get values without a full model on any rank:
1. `placeholders`, before `to_empty`: each target's meta bf16 shard becomes a meta NF4 shard (so `to_empty`
   allocates 4-bit storage, not the bf16 base), marked initialized for transformers' `_init_weights`.
2. `fill`, after the rest of the model is filled: per target, the whole bf16 tensor (read from model.weights, or
   the model's own init drawn as the bf16 path draws it, llmctl.engine.materialize) is quantized once, the same on
   every rank, and this rank's rows of it become the parameter. Quantizing the whole tensor (not each shard) matters:
   NF4's double quantization subtracts the mean of all the tensor's absmaxes, and FSDP2's all-gather rebuilds the
   tensor with the rank's copy of that mean. Peak memory: one whole weight at a time (fp32 on the host, then in the
   compute dtype on the device while it is quantized).
FSDP2 takes the new parameters at its lazy init (`FSDPParam.reset_sharded_param` and `_init_extensions`: the
mechanism torchtune's `load_state_dict(assign=True)` uses).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from llmctl.errors import InputError, SpecError
from llmctl.spec.nf4 import BLOCK, scaler_block

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmctl.engine")


def nf4_module() -> Any:
    """torchao's NF4 module (its path moved between torchao releases)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4_tensor  # older torchao
    return nf4_tensor


def check_installed() -> None:
    """One line before anything is built when torchao's NF4 is missing."""
    try:
        nf4_module()
    except ImportError:
        raise InputError(
            "finetune.method qlora needs torchao (its NF4 4-bit weights), which is not installed",
            hint="pip install 'llmctl[qlora]'",
        ) from None


def is_nf4(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return type(local).__name__ == "NF4Tensor"


def targets(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every nn.Linear inside the decoder layers: their weights go to NF4. Modules that are not
    nn.Linear (GPT-2's Conv1D) are refused: NF4Tensor implements F.linear, not Conv1D's addmm."""
    import torch

    from llmctl.families.modules import decoder_layers

    found = []
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear) and module.weight.ndim == 2 and not module.weight.requires_grad:
                found.append((f"layer {i}: {name}", module))
            elif type(module).__name__ == "Conv1D":
                raise SpecError(
                    f"qlora: {type(model).__name__}'s block matmuls are Conv1D layers, which llmctl's NF4 base "
                    "(torchao's, F.linear only) does not run",
                    hint="use finetune.method lora for this model",
                )
    return found


def shard_count(w: Any) -> int:
    """How many pieces FSDP2 cut a parameter into along dim 0 (1: not sharded)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(w, DTensor):
        return 1
    return math.prod(w.device_mesh.size(i) for i, pl in enumerate(w.placements) if pl.is_shard(0))


def split_targets(found: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    """The targets whose shape NF4 can shard as FSDP2 cut them; the others (a small MoE router, a projection too
    small for a large group) stay in the compute dtype, said once in the log. None at all is a plan error."""
    shard = max((shard_count(m.weight) for _, m in found), default=1)
    ok = [(n, m) for n, m in found if scaler_block(tuple(m.weight.shape), shard_count(m.weight))]
    kept = [f"{n} {list(m.weight.shape)}" for n, m in found if (n, m) not in ok]
    if kept:
        log.warning(
            "qlora: %d block linear(s) kept in the compute dtype (NF4 needs a multiple of %d x %d weights and of %d "
            "rows to shard): %s%s",
            len(kept),
            BLOCK,
            shard,
            shard,
            ", ".join(kept[:3]),
            ", ..." if len(kept) > 3 else "",
        )
    if found and not ok:
        raise SpecError(
            f"qlora: no block linear of this model can be split into NF4 shards over {shard} rank(s) "
            f"(e.g. {kept[0]}: NF4 needs a multiple of {BLOCK} x {shard} weights and of {shard} rows)",
            hint="use finetune.method lora for this model, or a smaller FSDP group",
        )
    return ok


def placeholders(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Step 1 (module doc): meta NF4 shards in place of the targets' meta bf16 ones. Returns the targets."""
    import torch
    from torch.distributed.tensor import DTensor

    nf4 = nf4_module()
    found = split_targets(targets(model))
    for _, module in found:
        w = module.weight
        local = w._local_tensor if isinstance(w, DTensor) else w
        sb = scaler_block(tuple(w.shape), shard_count(w))
        q = nf4.to_nf4(local.detach(), BLOCK, sb)  # meta in, meta out: shapes only
        if isinstance(w, DTensor):
            q = DTensor.from_local(q, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride())
        p = torch.nn.Parameter(q, requires_grad=False)
        p._is_hf_initialized = True  # transformers' init functions skip it: `fill` draws it whole
        module.weight = p
    return found


def _full_values(name: str, module: torch.nn.Module, owner: Any, weights: Any, prefixes: tuple[str, ...], seed: int):
    """The whole weight in fp32 on the host: from model.weights, or the model's own init drawn as the bf16 path
    draws it (the same block draws under the same name: a QLoRA base is NF4 of the LoRA base of the same seed)."""
    import torch

    from llmctl.engine.materialize import Slot, _sharded_draws, storage_key

    shape = tuple(module.weight.shape)
    if weights is not None:
        from safetensors import safe_open

        key = weights.find([name], prefixes)
        if key is None:
            raise SpecError(f"model.weights: {weights.folder} has no tensor {name}")
        path = weights.where[key]
        try:
            with safe_open(str(path), framework="pt") as f:
                full = f.get_tensor(key).float()
        except Exception as e:  # a damaged or unreadable file: one line, as materialize.load_weights says it
            raise SpecError(
                f"model.weights: cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            ) from None
        if tuple(full.shape) != shape:
            raise SpecError(
                f"model.weights: {key} has shape {list(full.shape)} but the config's model has {list(shape)}"
            )
        return full
    real = module.weight
    full = torch.zeros(shape, dtype=torch.float32)
    module.weight = torch.nn.Parameter(full, requires_grad=False)  # a world of one: the slot is every row
    slot = Slot([name], module.weight, shape, 0, shape[0], full)
    try:
        with torch.no_grad(), _sharded_draws({storage_key(module.weight): slot}, seed, set()):
            owner._init_weights(module)
    finally:
        module.weight = real
    return full


def own_rows(q: Any, rows: int, index: int) -> Any:
    """Piece `index` of an NF4 weight cut every `rows` rows, in storage of its own: `torch.split` gives views that
    keep the whole tensor's packed data alive on every rank (copied through NF4's empty_like + copy_, which keep
    the whole tensor's absmax mean: FSDP2's all-gather rebuilds the weight with it)."""
    import torch

    view = list(torch.split(q, rows, dim=0))[index]
    piece = torch.empty_like(view)
    piece.copy_(view)
    return piece


def fill(model: torch.nn.Module, found: list[tuple[str, torch.nn.Module]], weights: Any, seed: int) -> int:
    """Step 2 (module doc): each target quantized whole, this rank's rows kept. Returns the weights quantized."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from llmctl.engine.materialize import _post_order, clean_name

    nf4 = nf4_module()
    owners = {id(m): o for m, o in _post_order(model, model)}
    names = {id(m): clean_name(n + ".weight") for n, m in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    prefixes = (prefix + ".",) if prefix else ()
    total = 0
    with torch.no_grad():
        for _, module in found:
            w = module.weight
            local = w._local_tensor if isinstance(w, DTensor) else w
            device, dtype = local.device, local.dtype
            full = _full_values(names[id(module)], module, owners[id(module)], weights, prefixes, seed)
            full = full.to(device=device, dtype=dtype)
            q = nf4.to_nf4(full, BLOCK, local.scaler_block_size)
            if isinstance(w, DTensor):
                shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
                rows, first = int(shape[0]), int(offset[0])
                part = own_rows(q, rows, first // rows)
                q = DTensor.from_local(
                    part, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride()
                )
            del full
            module.weight = torch.nn.Parameter(q, requires_grad=False)
            total += int(w.numel())
    log.info("qlora: %d block linears (%s weights) stored in NF4", len(found), f"{total:,}")
    return total
