"""Materialize a model built on the meta device, after sharding, holding only this rank's shard.

The engine builds the model under `torch.device("meta")` (no memory), applies AC -> compile -> `fully_shard`, then
`to_empty(device)` allocates each rank's shard (FSDP2: a DTensor per parameter, rows [o, o + n) of dim 0) and
this module fills it, one of two ways:

- Random init with the model's own rules: Hugging Face's `_init_weights` is called on every module in the same
  post-order as `PreTrainedModel.initialize_weights` (norms to one, biases to zero, rotary `inv_freq` buffers
  recomputed, GPT-2's 1/sqrt(2L) residual projections, ...). Its random draws (`normal_`, `uniform_`) on a
  parameter are intercepted and replaced by a counter-based draw of only this rank's rows: the parameter is cut
  into fixed blocks of rows (about 2^16 values each, independent of the world size), block k drawn from a generator
  seeded by (seed, parameter name, k). Every rank thus draws ~1/W of the values, and the model is the same on 1, 2,
  4 or 64 ranks and on CPU or GPU (the draws are made on the CPU). Deterministic operations (fill, zero, copy, and
  the element-wise parts of truncated normal init) run on the local shard as they are.
- Local Hugging Face weights: each rank reads only its rows of each tensor from the `*.safetensors` files
  (`safe_open(...).get_slice(name)[o:o + n]`, memory-mapped: a rank touches only its slices), straight into its
  shard. The vocabulary rows padded on (model.pad_vocab_multiple) are set to zero; tied parameters are one tensor.
  This is the "equivalent that reads only each rank's slices" of DCP's HuggingFaceStorageReader, chosen because the
  padded vocabulary makes the engine's shapes differ from the file's, which DCP's loader refuses.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.errors import SpecError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmctl.engine")

BLOCK_VALUES = 1 << 16
"""Values per random block (a fixed number, so the blocks, and so the draws, do not depend on the world size)."""

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "base_layer.")


def clean_name(fqn: str) -> str:
    """A parameter's name without the AC/compile wrapper parts, nor peft's `base_layer.` (the frozen linear under a
    LoRA adapter): the Hugging Face name (as in safetensors)."""
    for part in _WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


@dataclass
class Slot:
    """One parameter: its names (tied parameters have several), global shape, and this rank's rows."""

    names: list[str]
    param: Any
    global_shape: tuple[int, ...]
    offset: int
    """First row (dim 0) of this rank's shard."""
    rows: int
    local: Any = field(repr=False)
    """The local tensor this rank holds (a view into FSDP2's sharded storage, or the parameter itself)."""
    col_offset: int = 0
    cols: int | None = None
    """A 2-D parameter split by columns too (a tensor-parallel rowwise weight): this rank's columns [col_offset,
    col_offset + cols) of its rows; None: all columns."""

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def row_values(self) -> int:
        return math.prod(self.global_shape[1:])


def plain(t: Any) -> Any:
    """The plain tensor inside a wrapper subclass of one inner tensor (torchao's float8 weights under FSDP2,
    WeightWithDynamicFloat8CastTensor, wrap the shard they cast), else `t`."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        if len(inner) != 1:
            break
        t = getattr(t, inner[0])
    return t


def local_block(param: Any) -> tuple[Any, int, int, int, int | None]:
    """(local tensor, first row, number of rows, first column, number of columns or None for all) of a parameter:
    a DTensor sharded on dim 0 (FSDP2, HSDP, a colwise TP weight, both), on dim 1 too (a rowwise TP weight, 2-D), or
    a plain tensor (a world of one: all rows)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        col_split = param.ndim == 2 and tuple(shape[1:]) != tuple(param.shape[1:])
        if any(o for o in offset[2:]) or tuple(shape[2:]) != tuple(param.shape[2:]) or (param.ndim > 2 and offset[1]):
            raise SpecError(f"parameter sharded on a dimension past 1 ({param.placements}): not supported")
        local = plain(param.to_local())
        rows, first = (int(shape[0]), int(offset[0])) if shape else (1, 0)
        return local, first, rows, int(offset[1]) if col_split else 0, int(shape[1]) if col_split else None
    return param, 0, int(param.shape[0]) if param.ndim else 1, 0, None


def local_rows(param: Any) -> tuple[Any, int, int]:
    """(local tensor, first row, number of rows) of a parameter split by rows only (see local_block)."""
    local, first, rows, _, cols = local_block(param)
    if cols is not None:
        raise SpecError(f"parameter split by columns ({param.placements}): expected rows only")
    return local, first, rows


def slots(model: torch.nn.Module) -> list[Slot]:
    """Every distinct parameter of the model with all its (clean) names, in module order."""
    by_id: dict[int, Slot] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        s = by_id.get(id(p))
        if s is None:
            local, off, rows, c0, cols = local_block(p)
            by_id[id(p)] = Slot([clean_name(fqn)], p, tuple(p.shape), off, rows, local, c0, cols)
        else:
            s.names.append(clean_name(fqn))
    return list(by_id.values())


def _block_seed(seed: int, name: str, block: int) -> int:
    h = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def draw_rows(slot: Slot, seed: int, kind: str, a: float, b: float) -> None:
    """Fill this rank's rows with the draws the whole tensor would have in those rows (normal(a, b) or
    uniform(a, b)), block by block; only the blocks that overlap the local rows are drawn. Draws are float32 on
    the CPU (the same numbers on every machine), straight into the shard where it is a CPU float32 tensor, else
    into a host buffer copied over once."""
    import torch

    if slot.rows == 0 or slot.local.numel() == 0:
        return
    per_row = max(1, slot.row_values)
    block_rows = max(1, BLOCK_VALUES // per_row)
    total_rows = slot.global_shape[0] if slot.global_shape else 1
    lo, hi = slot.offset, slot.offset + slot.rows
    whole_rows = slot.cols is None
    direct = (
        whole_rows
        and slot.local.device.type == "cpu"
        and slot.local.dtype == torch.float32
        and slot.local.is_contiguous()
    )
    # Columns split (TP rowwise): whole rows are drawn (the draws do not depend on the split), our columns kept.
    host = slot.local if direct else torch.empty((slot.rows, per_row), dtype=torch.float32)
    flat = host.view(slot.rows, per_row)
    gen = torch.Generator(device="cpu")

    def fill(t: torch.Tensor) -> None:
        if kind == "normal":
            t.normal_(a, b, generator=gen)
        else:
            t.uniform_(a, b, generator=gen)

    for k in range(lo // block_rows, (hi - 1) // block_rows + 1):
        b0 = k * block_rows
        b1 = min(b0 + block_rows, total_rows)
        gen.manual_seed(_block_seed(seed, slot.name, k))
        s0, s1 = max(lo, b0), min(hi, b1)
        if (s0, s1) == (b0, b1):  # the whole block is ours: draw in place
            fill(flat[s0 - lo : s1 - lo])
        else:  # a block cut by the shard edge: draw it whole, keep our rows
            vals = torch.empty(b1 - b0, per_row, dtype=torch.float32)
            fill(vals)
            flat[s0 - lo : s1 - lo].copy_(vals[s0 - b0 : s1 - b0])
    if not direct:
        if whole_rows:
            slot.local.copy_(host.view(slot.local.shape))
        else:
            slot.local.copy_(host[:, slot.col_offset : slot.col_offset + slot.cols])


def held_bytes(t: Any) -> int:
    """Bytes a parameter's local shard holds: numel x element size, or for a subclass that packs several tensors (an
    NF4 weight: 4-bit data, int8 absmaxes, their scales) the storage each keeps alive (a piece that is a view of the
    whole weight holds the whole weight)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    local = plain(t.to_local() if isinstance(t, DTensor) else t)
    if is_traceable_wrapper_subclass(local):
        names, _ = local.__tensor_flatten__()
        return sum(getattr(local, n).untyped_storage().nbytes() for n in names)
    return local.numel() * local.element_size()


def storage_key(t: Any) -> tuple[int, tuple[int, ...]] | None:
    """Identify a parameter by where its local values live (so `p.data` and `p` match) and its global shape."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(t, torch.Tensor):
        return None
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    local = plain(t.to_local() if isinstance(t, DTensor) else t)
    if local.device.type == "meta" or is_traceable_wrapper_subclass(local):  # an NF4 base weight: no one storage
        return None
    try:
        ptr = local.untyped_storage().data_ptr() + local.storage_offset() * local.element_size()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr, tuple(t.shape)


def _sharded_draws(by_key: dict[Any, Slot], seed: int, skip: set[int]) -> Any:
    """A TorchDispatchMode that turns `normal_`/`uniform_` on a model parameter (a DTensor or a plain tensor, at
    the aten level, so every torch.nn.init / transformers.initialization path is seen) into `draw_rows` on its
    local shard; other random ops on a parameter are refused rather than drawn inconsistently across ranks.
    (truncated-normal's rejection redraws go to fresh tensors, not the parameter: the few redrawn values come from
    the local generator.)"""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    other_random = {
        getattr(getattr(aten, op), overload)
        for op in ("bernoulli_", "cauchy_", "exponential_", "geometric_", "log_normal_", "random_")
        for overload in getattr(aten, op).overloads()
    }

    class ShardedDraws(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if func in (aten.normal_.default, aten.uniform_.default) or func in other_random:
                slot = by_key.get(storage_key(args[0])) if args else None
                if slot is not None:
                    if id(slot.param) in skip:
                        return args[0]
                    if func in other_random:
                        raise SpecError(
                            f"{slot.name}: the model's init uses {func}, which sharded init does not reproduce",
                            hint="report it; a workaround is model.weights with a saved initial model",
                        )
                    if func is aten.normal_.default:
                        a = args[1] if len(args) > 1 else kwargs.get("mean", 0.0)
                        b = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
                        draw_rows(slot, seed, "normal", float(a), float(b))
                    else:
                        a = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
                        b = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
                        draw_rows(slot, seed, "uniform", float(a), float(b))
                    return args[0]
            return func(*args, **kwargs)

    return ShardedDraws()


def _post_order(module: Any, owner: Any) -> Iterator[tuple[Any, Any]]:
    """(module, the PreTrainedModel whose `_init_weights` applies) in `initialize_weights`'s order: children first,
    a nested PreTrainedModel's own init for its subtree."""
    from transformers import PreTrainedModel

    for child in module.children():
        yield from _post_order(child, child if isinstance(child, PreTrainedModel) else owner)
    yield module, owner


def init_weights(model: torch.nn.Module, seed: int, skip: set[int] | None = None) -> list[Slot]:
    """Random init in place of a materialized (to_empty) model, shard by shard; see the module doc.
    `skip`: ids of parameters to leave for a loader (their random draws are not made)."""
    import torch
    from torch.distributed.tensor import DTensor

    all_slots = slots(model)
    by_key = {storage_key(s.param): s for s in all_slots}
    with torch.no_grad(), _sharded_draws(by_key, seed, skip or set()):
        for module, owner in _post_order(model, model):
            owner._init_weights(module)
    # `init.zeros_(weight[padding_idx])` on a DTensor zeroes a gathered copy, not the shard: redo it on the shard.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                w = module.weight
                if id(w) in (skip or set()):
                    continue
                local, off, rows = local_rows(w)
                idx = module.padding_idx % w.shape[0]
                if off <= idx < off + rows:
                    local[idx - off].zero_()
                elif not isinstance(w, DTensor):
                    w[idx].zero_()
    return all_slots


# ---------------------------------------------------------------------------------------------- Hugging Face weights


@dataclass(frozen=True)
class WeightFiles:
    """Where each tensor of a local Hugging Face folder lives."""

    folder: Path
    where: dict[str, Path]
    """tensor name -> safetensors file."""

    @classmethod
    def scan(cls, folder: str | Path) -> WeightFiles:
        from safetensors import safe_open

        root = Path(folder)
        if not root.is_dir():
            raise SpecError(f"model.weights: {root} is not a folder")
        index = root / "model.safetensors.index.json"
        files = sorted(root.glob("*.safetensors"))
        if not files:
            bins = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
            if bins:
                raise SpecError(
                    f"model.weights: {root} has only PyTorch pickle weights ({bins[0]}{', ...' if len(bins) > 1 else ''}),"
                    " no *.safetensors",
                    hint="convert once: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) "
                    "(writes safetensors), then point model.weights at OUT",
                )
            raise SpecError(f"model.weights: no *.safetensors files in {root}")
        where: dict[str, Path] = {}
        if index.is_file():
            from llmctl.fileio import load_json

            data = load_json(index, "safetensors index")
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict):
                raise SpecError(f"{index}: no weight_map")
            for name, fname in wm.items():
                p = root / str(fname)
                if not p.is_file():
                    raise SpecError(f"{index}: {name} is in {fname}, which is missing")
                where[str(name)] = p
            return cls(root, where)
        for p in files:
            try:
                with safe_open(str(p), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                        where[name] = p
            except Exception as e:  # safetensors raises its own error types for a damaged header
                raise SpecError(f"model.weights: cannot read {p}: {str(e).splitlines()[0][:200]}") from None
        return cls(root, where)

    def find(self, names: list[str], prefixes: tuple[str, ...]) -> str | None:
        """The file's name for a parameter: any of its (tied) names, with or without the base-model prefix."""
        for n in names:
            if n in self.where:
                return n
        for n in names:
            for pre in prefixes:
                if n.startswith(pre) and n[len(pre) :] in self.where:
                    return n[len(pre) :]
                if pre + n in self.where:
                    return pre + n
        return None


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def load_weights(
    model: torch.nn.Module, files: WeightFiles, vocab_rows: int, skip: Callable[[Slot], bool] | None = None
) -> dict[str, Any]:
    """Read this rank's rows of every parameter from the safetensors files into its shard (see the module doc).
    `vocab_rows`: the unpadded vocabulary; a tensor with that many rows where the model has more (the padded
    embedding / LM head) is read into the first rows and the rest set to zero. `skip`: the parameters the files do
    not fill (the caller knows them: LoRA adapters, QLoRA's NF4 weights). Returns a summary."""
    import torch
    from safetensors import safe_open

    prefix = getattr(model, "base_model_prefix", "") or ""
    prefixes = (prefix + ".",) if prefix else ()
    loaded, bytes_read = 0, 0
    todo = [s for s in slots(model) if skip is None or not skip(s)]
    names = {s.name: s for s in todo}
    plan: dict[Path, list[tuple[Slot, str]]] = {}
    for s in todo:
        key = files.find(s.names, prefixes)
        if key is None:
            raise SpecError(
                f"model.weights: {files.folder} has no tensor {s.name}"
                + (f" (nor {', '.join(s.names[1:])})" if len(s.names) > 1 else ""),
                hint="the folder's model differs from the config (or its tensor names need a conversion "
                "transformers applies; supported: checkpoints whose names are the module names)",
            )
        plan.setdefault(files.where[key], []).append((s, key))
    with torch.no_grad():
        for path, items in plan.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for s, key in items:
                        sl = f.get_slice(key)
                        shape = tuple(sl.get_shape())
                        rows_in_file = shape[0] if shape else 1
                        padded = (
                            len(shape) == len(s.global_shape)
                            and shape[1:] == s.global_shape[1:]
                            and rows_in_file == vocab_rows
                            and s.global_shape[0] > vocab_rows
                        )
                        if shape != s.global_shape and not padded:
                            raise SpecError(
                                f"model.weights: {key} in {path.name} has shape {list(shape)} but the config's "
                                f"model has {list(s.global_shape)}",
                                hint="model.overrides or the config.json disagree with the weights",
                            )
                        lo, hi = s.offset, s.offset + s.rows
                        if s.rows == 0:
                            continue
                        if not s.global_shape:  # a scalar parameter
                            s.local.copy_(f.get_tensor(key))
                            continue
                        have = min(hi, rows_in_file)
                        if lo < have:
                            part = sl[lo:have] if s.cols is None else sl[lo:have, s.col_offset : s.col_offset + s.cols]
                            bytes_read += part.numel() * part.element_size()
                            s.local[: have - lo].copy_(part)
                        if hi > rows_in_file:
                            s.local[max(0, rows_in_file - lo) :].zero_()
                        loaded += 1
            except SpecError:
                raise
            except Exception as e:  # an unreadable or damaged file
                raise SpecError(
                    f"model.weights: cannot read {path}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                ) from None
    unused = len(set(files.where) - {k for items in plan.values() for _, k in items})
    return {"tensors": loaded, "bytes_read": bytes_read, "unused_in_files": unused, "params": len(names)}
