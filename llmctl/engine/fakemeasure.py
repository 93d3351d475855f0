"""Measure any transformers causal LM on fake tensors: its parameter counts and the bytes its training forward saves.

A Hugging Face `model_type` that llmctl has no analytical model for (llmctl.spec.families) is measured instead:

- Parameters: the full model is built on the meta device (shapes, no memory) and counted exactly.
- Activations: a training forward (train mode, so dropout masks count) runs under `FakeTensorMode`, which computes
  shapes and dtypes but no values and allocates nothing: measuring a Llama-3-70B-shaped config takes ~3 s on a
  laptop CPU. Every tensor autograd saves for backward (`saved_tensors_hooks`) is counted once per storage (fake
  tensors have no data_ptr; the address of the StorageImpl, `StorageWeakRef(...).cdata`, identifies them, and views
  such as the one input q/k/v all save share it), parameters, buffers and the batch excluded. A saved storage is
  charged to the region that *created* it: the decoder layer running at the time, or the head (everything outside
  the layers: embeddings, rotary tables, masks, final norm, lm head, loss). Charging by creation rather than by saver
  gives every layer the same bytes (each layer owns its output, whoever saves it) and leaves tensors shared by all
  layers (RoPE cos/sin, masks) to the head once, so `sum(kind bytes x count) + head` is the model's saved bytes.
- Full activation checkpointing wraps each layer in non-reentrant `torch.utils.checkpoint`; a checkpointed layer
  keeps alive every tensor it was called with (positional ones through its saved inputs, keyword ones through the
  recompute closure), which are counted too: for a Llama that is the layer input, b*s*h*act_bytes.
- The activation model is shorter than the real one when it can be: the shortest prefix of layers that holds every
  kind, plus one layer so that every kind is measured where a layer follows it (per-layer config lists such as
  `layer_types` are cut to match; a kind found only in the last layer is measured in a model one layer deeper, the
  lists repeated from their start; when the built model's first layers do not have the full model's signatures,
  the full depth is measured). Parameters always come from the full model.
- Bytes are fit as a*b*s + c*b*s*s through two sequence lengths at b=1 and checked at a third (SEQ_LENS).
- MoE layers run transformers' grouped-mm experts: every token's top-k rows, whatever the routing (fake tensors
  have no values to route by), as the grouped GEMM kernels of GPU training do.

Fake tensors run the CPU kernels, which differ from the GPU ones in two places that change memory; both are patched
to what a GPU does while measuring: dropout keeps a 1-byte mask (`native_dropout`, as CUDA does) instead of a mask
in the activation dtype, and sdpa with dropout, or with a value head size unlike the query's (MLA), uses a fused
kernel (CUDA's flash/memory-efficient kernels drop out inside the kernel and take any value head size) instead of
the CPU's math fallback that saves the s*s probabilities. transformers also treats a fake tensor as "tracing" and
then assumes packed sequences (a mask, no GQA in sdpa); the batch here is one unpadded
sequence per row, so packed-sequence detection is switched off. A real CPU forward without dropout, with the same
hooks, saves exactly the bytes the fake one reports (tests/engine/test_fakemeasure.py).

`measure_config(cfg)` returns plain JSON data, cached as `cache_dir/<config_hash>.json`:

    version            MEASURE_VERSION
    model_type         cfg["model_type"]
    config_hash        sha256 of the canonical JSON of cfg, MEASURE_VERSION and the torch and transformers versions
    total_params       sum(p.numel()) over model.parameters() of the full model (tied parameters once)
    embedding_params   nn.Embedding parameters outside the decoder layers (token, position, per-layer embeddings)
    head_params        everything else outside the decoder layers (final norm, an untied lm_head)
    layers             one entry per decoder-layer kind, layers grouped by (class, sorted parameter names and shapes,
                       attention type: layer attributes such as attention_type / sliding_window and per-layer
                       config lists such as layer_types):
                       {"kind": id, "params": per layer, "count": n, "indices": [i, ...], "matmul_params": per layer
                       (parameters of >= 2-D weights), "active_params" / "active_matmul_params": the same per token (routed
                       experts count k/E)}. Layers sharing weights (zamba) count them in each kind.
    saved              {"<act_bytes>/<attention>/<checkpointing>": {"<kind>": [a, c]}}, act_bytes in {4, 2}
                       (fp32, bf16 weights and activations), attention in {sdpa, eager}, checkpointing in
                       {none, full}: one layer of that kind saves a*b*s + c*b*s*s bytes for backward
    head_saved         {"<act_bytes>/<attention>": [a, c]}: what the head saves, same form, without checkpointing
                       (position tables of shape (1, s, d) do not grow with b: at b > 1 this slightly overcounts)
    head_saved_checkpointed  the same when every layer is fully checkpointed: the checkpoints also keep what the
                       head passes every layer, such as eager attention's (b, 1, s, s) mask
    attention_used     {"sdpa": impl, "eager": impl}: what transformers built (models without sdpa use eager)
    fit_error          only when a fit misses the third length by more than FIT_TOLERANCE:
                       {"<act_bytes>/<attention>/<checkpointing>/<kind or head>": relative error}
    seconds            time the measurement took (a cache hit returns the original)

Engine layer: torch and transformers are imported inside functions, so importing this module (and a cache hit,
which reads package versions from metadata) stays cheap.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from importlib import metadata, util
from pathlib import Path
from typing import Any

from llmctl.errors import SpecError, one_line, suggest

MEASURE_VERSION = 2
"""Bump when the method changes: it is part of the cache key."""

ACT_BYTES = {4: "float32", 2: "bfloat16"}
ATTENTIONS = ("sdpa", "eager")
CHECKPOINTING = ("none", "full")
SEQ_LENS = (256, 512, 1024)
"""Sequence lengths measured at b=1: the fit goes through the first two and is checked at the third (other lengths
for short position tables and sliding windows: _seq_lens)."""
FIT_TOLERANCE = 0.01
CACHE_ENV = "LLMCTL_CACHE_DIR"
HEAD = -1
"""The region of everything outside the decoder layers."""

# Where common families keep their decoder layers; else the largest ModuleList of one class is taken.
_LAYER_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers", "transformer.layers")
# Attributes of a layer (or its direct children, the attention module) that say which attention it runs.
_ATTENTION_ATTRS = (
    "attention_type",
    "layer_type",
    "is_sliding",
    "sliding_window",
    "use_sliding_window",
    "attention_chunk_size",
    "use_rope",
)
_RESULT_KEYS = (
    "version",
    "model_type",
    "config_hash",
    "total_params",
    "embedding_params",
    "head_params",
    "layers",
    "saved",
    "head_saved",
    "head_saved_checkpointed",
    "attention_used",
    "seconds",
)

log = logging.getLogger("llmctl.engine")


def available() -> bool:
    """Whether torch and transformers are installed (found without importing them)."""
    return all(util.find_spec(m) is not None for m in ("torch", "transformers"))


def default_cache_dir() -> Path:
    """$LLMCTL_CACHE_DIR, else $XDG_CACHE_HOME/llmctl/measured, else ~/.cache/llmctl/measured."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "llmctl" / "measured"


def config_hash(cfg: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of cfg, MEASURE_VERSION and the torch and transformers versions (read from the
    installed packages' metadata: a cache hit never imports torch)."""
    payload = {
        "config": cfg,
        "measure_version": MEASURE_VERSION,
        "torch": _package_version("torch"),
        "transformers": _package_version("transformers"),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def measure_config(
    cfg: dict,
    *,
    cache_dir: Path | None = None,
    refresh: bool = False,
    announce: Callable[[Path], None] | None = None,
) -> dict:
    """Measure a Hugging Face config (config.json contents as a dict, with model_type): see the module docstring.
    The result is cached; `refresh` measures again. `announce(cache file)` is called when a measurement starts, once
    transformers has accepted the config. Raises SpecError (one line) for a config that cannot be built or
    measured."""
    model_type = _model_type(cfg)
    if not available():
        raise SpecError(
            f"model_type {model_type!r}: measuring it needs torch and transformers", hint="pip install 'llmctl[train]'"
        )
    key = config_hash(cfg)
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{key}.json"
    if not refresh:
        cached = _read_cache(path, key)
        if cached is not None:
            return cached
    result = _measure(cfg, model_type, key, lambda: announce(path) if announce else None)
    _write_cache(path, result)
    return result


def install() -> None:
    """Make llmctl.spec measure model types outside the analytical families with `measure_config` (default cache).
    Cheap: nothing heavy is imported until a config needs measuring."""
    from llmctl.spec import models

    models.set_measurer(_measure_announced)


def _measure_announced(cfg: dict) -> dict:
    """measure_config, saying on stderr what takes the seconds when it is not a cache hit."""
    import sys

    def announce(path: Path) -> None:
        print(
            f"llmctl: measuring model_type {cfg.get('model_type')!r} on fake tensors (no analytical model; "
            f"cached in {path.parent})",
            file=sys.stderr,
        )

    return measure_config(cfg, announce=announce)


# --- cache ---------------------------------------------------------------------------------------------------------
def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def _read_cache(path: Path, key: str) -> dict | None:
    """The cached result, or None when there is none or it is unreadable (a crash mid-write, a hand edit)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError covers bad JSON and bad UTF-8
        log.warning("re-measuring: unreadable cache file %s (%s)", path, one_line(str(e)))
        return None
    ok = (
        isinstance(data, dict)
        and all(k in data for k in _RESULT_KEYS)
        and data["version"] == MEASURE_VERSION
        and data["config_hash"] == key
    )
    if not ok:
        log.warning("re-measuring: cache file %s is not a measurement of this config", path)
        return None
    return data


def _write_cache(path: Path, result: dict) -> None:
    """Write atomically (a temporary file in the same folder, then os.replace): readers never see half a file. A
    cache that cannot be written costs a re-measurement next time, not this result."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(result, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("could not cache the measurement in %s: %s", path, one_line(str(e)))


# --- building --------------------------------------------------------------------------------------------------------
def _model_type(cfg: Any) -> str:
    if not isinstance(cfg, dict):
        raise SpecError(f"a model config is a JSON object with model_type, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise SpecError("the model config has no model_type", hint='config.json names it, e.g. "model_type": "llama"')
    return mt


def _first_line(e: BaseException) -> str:
    """The exception in one line: its first line, and the second when the first only introduces it (huggingface_hub's
    "Class validation error for validator 'validate_architecture':")."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _config(cfg: dict, model_type: str) -> Any:
    """The transformers config, use_cache off (training)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING:
        custom = "auto_map" in cfg  # a model whose code ships with its weights: llmctl does not run remote code
        raise SpecError(
            f"model_type {model_type!r}: transformers {transformers.__version__} does not know it",
            hint="its config.json names custom code (auto_map), which llmctl does not run"
            if custom
            else suggest(model_type, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)) or "a newer transformers may",
        )
    rest = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype", "dtype")}
    try:
        config = AutoConfig.for_model(model_type, **rest)
    except Exception as e:  # noqa: BLE001 - config checks raise several types (StrictDataclassError, TypeError,
        # ValueError, KeyError) for values in the file: each is a bad input, not a bug
        raise SpecError(f"model_type {model_type!r}: transformers rejects the config: {_first_line(e)}") from None
    config.use_cache = False
    return config


def _build(config: Any, model_type: str, dtype_name: str, attention: str | None = None) -> Any:
    """The causal LM on the meta device (no memory). Raises SpecError when transformers cannot build it."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype_name)}
    if attention:
        kwargs["attn_implementation"] = attention
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)
    except Exception as e:  # noqa: BLE001 - same: an unbuildable config (or no causal LM for it) is a bad input
        raise SpecError(f"model_type {model_type!r}: transformers cannot build a causal LM: {_first_line(e)}") from e
    model.config.use_cache = False
    return model


def _build_attention(config: Any, model_type: str, dtype_name: str, attention: str) -> tuple[Any, str]:
    """(model, attention transformers used): a model without sdpa support is built with eager."""
    try:
        model = _build(config, model_type, dtype_name, attention)
    except SpecError:
        if attention == "eager":
            raise
        model = _build(config, model_type, dtype_name, "eager")
    return model, str(getattr(model.config, "_attn_implementation", None) or attention)


def decoder_layers(model: Any, model_type: str = "") -> Any:
    """The ModuleList of decoder layers: a known path (model.layers, transformer.h, ...), else the ModuleList of one
    class holding the most parameters."""
    import torch

    for path in _LAYER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return obj
    best, best_params = None, 0
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > best_params:
                best, best_params = m, n
    if best is None:
        raise SpecError(
            f"model_type {model_type or type(model).__name__!r}: cannot find the decoder layers of "
            f"{type(model).__name__} (no ModuleList of one layer class)"
        )
    return best


def _config_value(config: Any, name: str) -> Any:
    """config.name, or None when reading it fails (some configs refuse global reads of per-layer values)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a property of someone else's config class
        return None


def _per_layer_lists(config: Any, num_layers: int) -> list[str]:
    """Config attributes that are lists with one entry per layer (layer_types, no_rope_layers, ...)."""
    names = []
    for name in sorted(config.to_dict()):
        value = _config_value(config, name)
        if isinstance(value, (list, tuple)) and len(value) == num_layers and num_layers > 0:
            names.append(name)
    return names


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _signature(layer: Any, index: int, config: Any, lists: list[str]) -> tuple:
    """What makes two decoder layers the same kind: class, parameter names and shapes, and attention type (layer
    attributes and this layer's entries in per-layer config lists)."""
    shapes = tuple(sorted((name, tuple(p.shape)) for name, p in layer.named_parameters()))
    tags: list[tuple[str, Any]] = []
    for owner, module in (("", layer), *((f"{n}.", c) for n, c in layer.named_children())):
        for attr in _ATTENTION_ATTRS:
            value = getattr(module, attr, None)
            if value is not None and _scalar(value):
                tags.append((owner + attr, value))
    for name in lists:
        value = getattr(config, name)[index]
        if _scalar(value):
            tags.append((f"config.{name}", value))
    return (type(layer).__name__, shapes, tuple(tags))


def _kind_ids(signatures: list[tuple]) -> dict[tuple, str]:
    """signature -> readable kind id: the class name, its attention type names, and the first index if that is
    still ambiguous (a dense and an MoE layer of one class)."""
    first: dict[tuple, int] = {}
    for i, sig in enumerate(signatures):
        first.setdefault(sig, i)
    names = {}
    for sig in first:
        labels = list(dict.fromkeys(v for _, v in sig[2] if isinstance(v, str)))
        names[sig] = "/".join([sig[0], *labels])
    taken = Counter(names.values())
    return {sig: (n if taken[n] == 1 else f"{n}@{first[sig]}") for sig, n in names.items()}


def _text_config(config: Any) -> Any:
    """The config that describes the decoder: `text_config` of a multimodal config (Gemma 4, Qwen3.5), else itself."""
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001 - older transformers, or a config class without text/sub-config logic
        return config


def _layer_table(model: Any, config: Any, layers: Any) -> tuple[list[tuple], list[str]]:
    text = _text_config(config)
    lists = _per_layer_lists(text, len(layers))
    return [_signature(layer, i, text, lists) for i, layer in enumerate(layers)], lists


def _short_config(config: Any, n: int, lists: list[str]) -> Any:
    """The config cut to its first n layers, per-layer lists cut to match; n past the depth repeats the lists from
    their start (a model one layer deeper than the real one, whose first layers are the real ones)."""
    short = copy.deepcopy(config)
    text = _text_config(short)  # the same object as the copy's text_config: cutting it cuts the copy
    text.num_hidden_layers = n
    for name in lists:
        value = getattr(text, name)
        setattr(text, name, type(value)(value[i % len(value)] for i in range(n)))
    return short


def _param_counts(model: Any, layers: Any, kinds: list[str], config: Any) -> dict[str, Any]:
    import torch

    layer_ids = {id(p) for p in layers.parameters()}
    embedding = {
        id(p): p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
        if id(p) not in layer_ids
    }
    total = sum(p.numel() for p in model.parameters())
    in_layers = sum(p.numel() for p in layers.parameters())
    table: dict[str, dict[str, Any]] = {}
    for i, (layer, kind) in enumerate(zip(layers, kinds)):
        if kind not in table:
            params = list(layer.parameters())
            table[kind] = {
                "kind": kind,
                "params": sum(p.numel() for p in params),
                "count": 0,
                "indices": [],
                "matmul_params": sum(p.numel() for p in params if p.dim() >= 2),
                **_active_counts(layer, config),
            }
        table[kind]["count"] += 1
        table[kind]["indices"].append(i)
    return {
        "total_params": total,
        "embedding_params": sum(embedding.values()),
        "head_params": total - sum(embedding.values()) - in_layers,
        "layers": list(table.values()),
    }


def _active_counts(layer: Any, config: Any) -> dict[str, int]:
    """A layer's parameters one token passes through: its routed experts (submodules named `experts`, transformers'
    convention for routed experts; shared experts have other names) count k/E, k the router's `top_k` (or the
    config's num_experts_per_tok), E the experts' `num_experts` (or their ModuleList length, or the grouped
    weights' leading dimension). A layer whose k cannot be found counts all of them (an upper bound)."""
    import torch

    experts = [m for n, m in layer.named_modules() if n.rsplit(".", 1)[-1] == "experts"]
    params = list(layer.parameters())
    active = sum(p.numel() for p in params)
    matmul = sum(p.numel() for p in params if p.dim() >= 2)
    k = next((m.top_k for m in layer.modules() if isinstance(getattr(m, "top_k", None), int)), None)
    k = k or _config_value(_text_config(config), "num_experts_per_tok")
    for module in experts:
        own = list(module.parameters())
        if isinstance(getattr(module, "num_experts", None), int):
            e = module.num_experts
        elif isinstance(module, torch.nn.ModuleList):
            e = len(module)
        else:
            e = own[0].shape[0] if own and own[0].dim() >= 3 else 0
        if not isinstance(k, int) or not own or not 0 < k < e:
            continue
        idle = 1 - k / e
        active -= round(idle * sum(p.numel() for p in own))
        matmul -= round(idle * sum(p.numel() for p in own if p.dim() >= 2))
    return {"active_params": active, "active_matmul_params": matmul}


# --- saved-for-backward bytes ----------------------------------------------------------------------------------------
def storage_key(t: Any) -> int:
    """A storage's identity that works for fake tensors (no data_ptr): the address of its StorageImpl, shared by
    all views of it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


def to_fake(model: Any, mode: Any) -> Any:
    """Replace the meta model's parameters, buffers and tensor attributes by fake CPU tensors of the same shape and
    dtype (tied parameters stay tied)."""
    import torch

    memo: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if id(t) not in memo:
            with mode:
                new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
        return memo[id(t)]

    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake(t)
        for name, t in list(vars(m).items()):
            if isinstance(t, torch.Tensor):  # e.g. rotary embeddings' original_inv_freq, a plain attribute
                setattr(m, name, fake(t))
    return model


@contextlib.contextmanager
def _as_on_gpu() -> Iterator[None]:
    """Patch the CPU/GPU differences that change saved memory (module docstring) for the duration."""
    import importlib
    from unittest import mock

    import torch
    import torch.nn.functional as F

    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def gpu_dropout(input, p=0.5, training=True, inplace=False):  # noqa: ANN001, A002 - F.dropout's signature
        if training and 0.0 < p < 1.0:
            return torch.native_dropout(input, p, True)[0]  # saves a bool mask, as CUDA's dropout does
        return dropout(input, p, training, inplace)

    def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001
        if query.shape[-1] != value.shape[-1] and key.shape[-3] == query.shape[-3] and _is_fake(query):
            # MLA (v_head_dim != qk head dim): CUDA runs the memory-efficient kernel (flash needs equal head dims),
            # which keeps q, k, v, the output and a logsumexp; the CPU would fall back to the math path and keep the
            # s*s probabilities. The efficient kernel has a fake (meta) implementation and a derivative.
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it for that kernel
                attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
            efficient = torch.ops.aten._scaled_dot_product_efficient_attention
            return efficient(query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        if dropout_p > 0.0 and not enable_gqa:  # the fused kernel drops out inside: no s*s tensor is saved
            cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return cpu_flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    transformers_patches = [
        ("transformers.masking_utils", "find_packed_sequence_indices", lambda position_ids: None),
        # torch's grouped_mm has fake kernels for bf16 only; transformers' own grouped-mm op saves the same tensors
        # (the sorted token rows; the weights are parameters) and has a fake kernel for every dtype
        ("transformers.integrations.moe", "_can_use_grouped_mm", lambda *args, **kwargs: False),
    ]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(F, "dropout", gpu_dropout))
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", gpu_sdpa))
        for module_name, name, replacement in transformers_patches:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # an older transformers without it: nothing to patch
                continue
            if hasattr(module, name):
                stack.enter_context(mock.patch.object(module, name, replacement))
        yield


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class _CheckpointedForward:
    """A layer's forward run under non-reentrant checkpointing (set as the instance's `forward`, so hooks on the
    layer run outside the checkpoint)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def saved_bytes(
    model: Any,
    layers: Any,
    batch: int,
    seq: int,
    checkpointing: str = "none",
    mode: Any = None,
    key: Callable[[Any], int] = storage_key,
) -> tuple[list[int], int]:
    """(bytes each decoder layer saves for backward, bytes the head saves) in one training forward of a `batch` x
    `seq` batch. `mode` is the FakeTensorMode the model's tensors belong to (None: a real model); `key` identifies
    storages (storage_key for fake tensors; a real run may use data_ptr)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    # Storages are tracked by weak reference, as llmctl.engine.memtrack does: a storage freed during forward (the
    # saved tensors of a result nobody uses) is not held for backward, and its key may come back for a new one.
    created: dict[int, tuple[Any, int]] = {}  # storage key -> (weak ref, region that created it)
    saved: dict[int, tuple[Any, int, int]] = {}  # storage key -> (weak ref, region, bytes)
    region = [HEAD]

    def live(table: dict[int, Any], k: int) -> Any:
        entry = table.get(k)
        return entry if entry is not None and not entry[0].expired() else None

    class Creators(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and live(created, key(t)) is None:  # views keep their creator
                    created[key(t)] = (StorageWeakRef(t.untyped_storage()), region[0])
            return out

    # Parameters, buffers and the batch are not activations. Weak references here too: a model may replace a buffer
    # during forward (CTRL casts its position table), and the freed one's key may come back for an activation.
    excluded = {key(t): (StorageWeakRef(t.untyped_storage()),) for t in (*model.parameters(), *model.buffers())}

    def keep(t: Any) -> None:
        k = key(t)
        if live(excluded, k) is not None or live(saved, k) is not None:
            return
        storage = t.untyped_storage()
        creator = live(created, k)
        saved[k] = (StorageWeakRef(storage), creator[1] if creator else HEAD, storage.nbytes())

    def pack(t: Any) -> Any:
        keep(t)
        return t

    def enter(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            region[0] = index
            if checkpointing == "full":  # the checkpoint keeps every tensor the layer was called with
                for t in tree_leaves((args, kwargs)):
                    if isinstance(t, torch.Tensor):
                        keep(t)

        return hook

    def leave(module: Any, args: Any, output: Any) -> None:
        region[0] = HEAD

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(leave))
        if checkpointing == "full":
            layer.forward = _CheckpointedForward(layer.forward)
    per_layer = [0] * len(layers)
    head = 0
    try:
        model.train()
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
            stack.enter_context(_as_on_gpu())
            ids = torch.zeros(batch, seq, dtype=torch.long)
            excluded[key(ids)] = (StorageWeakRef(ids.untyped_storage()),)
            stack.enter_context(Creators())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            output = model(input_ids=ids, labels=ids)
        # Counted while `output` keeps the autograd graph alive: what is still there is what backward will use.
        for ref, where, nbytes in saved.values():
            if ref.expired():
                continue
            if where == HEAD:
                head += nbytes
            else:
                per_layer[where] += nbytes
        del output
    finally:
        for h in handles:
            h.remove()
        for layer in layers:
            if isinstance(vars(layer).get("forward"), _CheckpointedForward):
                del layer.forward
    return per_layer, head


def _positive_ints(config: Any, names: tuple[str, ...]) -> list[int]:
    values = (_config_value(config, n) for n in names)
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]


def _seq_lens(config: Any) -> tuple[int, int, int]:
    """Three lengths within the model's positions: 256, 512, 1024 by default. With a sliding window (or attention
    chunk) of w >= 256, all three are at or past it (2w, 4w, 8w, or half, three quarters and all of the positions):
    below the window sdpa skips the mask, and a fit through both regimes predicts neither; past it is where
    long-context training, the case memory planning is about, runs. Learned positions fewer than 1024 (BERT's 512):
    a quarter, half and all of them."""
    configs = (config, _text_config(config))
    positions = [v for c in configs for v in _positive_ints(c, ("max_position_embeddings", "n_positions", "n_ctx"))]
    windows = [v for c in configs for v in _positive_ints(c, ("sliding_window", "attention_chunk_size"))]
    most, window = min(positions, default=SEQ_LENS[-1]), min(windows, default=0)
    n = SEQ_LENS[0]
    if window >= n and 8 * window <= most:
        return (2 * window, 4 * window, 8 * window)
    if window >= n and 2 * window <= most:
        return (most // 2, 3 * most // 4, most)
    if 4 * n > most and most >= 8:
        n = most // 4
    return (n, 2 * n, 4 * n)


def _fit(points: dict[int, int]) -> tuple[list[float], float]:
    """([a, c] with bytes = a*s + c*s*s at b=1 through the two shorter lengths, relative error at the longest)."""
    (s1, y1), (s2, y2), (s3, y3) = sorted(points.items())
    c = (y2 / s2 - y1 / s1) / (s2 - s1)
    a = y1 / s1 - c * s1
    predicted = a * s3 + c * s3 * s3
    error = abs(predicted - y3) / y3 if y3 else abs(predicted)
    return [a, c], error


# --- the measurement -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Measuring is not the user's training run: transformers' config advice, torch's warnings and the traceback
    torch logs when a fake kernel fails (the failure itself becomes one SpecError line) are kept off the terminal."""
    import warnings

    from transformers.utils import logging as hf_logging

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    verbosity, level = hf_logging.get_verbosity(), fake_log.level
    hf_logging.set_verbosity_error()
    fake_log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        fake_log.setLevel(level)


def _measure(cfg: dict, model_type: str, key: str, started: Callable[[], None] = lambda: None) -> dict:
    with _quiet():
        return _measure_quietly(cfg, model_type, key, started)


def _measure_quietly(cfg: dict, model_type: str, key: str, started: Callable[[], None]) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    config = _config(cfg, model_type)
    started()
    full = _build(config, model_type, "float32")
    layers = decoder_layers(full, model_type)
    signatures, lists = _layer_table(full, config, layers)
    kind_of = _kind_ids(signatures)
    kinds = [kind_of[s] for s in signatures]
    counts = _param_counts(full, layers, kinds, config)
    # The shortest prefix holding one layer of every kind, and one layer more: a layer's output is saved by the
    # next layer (or held by its checkpoint), while after the last layer the final norm may save a converted copy
    # (RMSNorm's fp32 upcast of bf16) that belongs to the head. Kinds are measured where a layer follows them; a
    # kind found only in the last layer is measured in a model one layer deeper (_short_model).
    depth = 2 + max(kinds.index(k) for k in set(kinds))
    seq_lens = _seq_lens(config)
    del full, layers

    result: dict[str, Any] = {"version": MEASURE_VERSION, "model_type": model_type, "config_hash": key, **counts}
    saved: dict[str, dict[str, list[float]]] = {}
    head_saved: dict[str, list[float]] = {}
    head_checkpointed: dict[str, list[float]] = {}
    used: dict[str, str] = {}
    fit_error: dict[str, float] = {}
    for attention in ATTENTIONS:
        for act_bytes, dtype_name in ACT_BYTES.items():
            if used.get(attention) == "eager" and attention != "eager":
                continue  # a model without sdpa: measured with eager below, copied after the loop
            model, used[attention] = _short_model(config, model_type, dtype_name, attention, depth, signatures, lists)
            if used[attention] == "eager" and attention != "eager":
                continue
            layers = decoder_layers(model, model_type)
            mode = FakeTensorMode()
            to_fake(model, mode)
            for ckpt in CHECKPOINTING:
                by_len = {s: _run(model, layers, s, ckpt, mode, model_type) for s in seq_lens}
                if ckpt == "none" and not any(any(v[0]) for v in by_len.values()):
                    # Every layer with parameters saves its matmul inputs: the model ran its layers without
                    # calling them as modules (no hooks), and their bytes would be charged to the head.
                    raise SpecError(
                        f"model_type {model_type!r}: its decoder layers ({type(layers[0]).__name__}) saved nothing "
                        "for backward while running; cannot tell their activations from the rest"
                    )
                name = f"{act_bytes}/{attention}/{ckpt}"
                saved[name] = {}
                real = min(len(layers), len(kinds))  # a deeper model's extra layer is not one of the real ones
                for kind in dict.fromkeys(kinds[:real]):
                    at = [i for i in range(real) if kinds[i] == kind]
                    at = [i for i in at if i < len(layers) - 1] or at
                    saved[name][kind], err = _fit({s: max(v[0][i] for i in at) for s, v in by_len.items()})
                    if err > FIT_TOLERANCE:
                        fit_error[f"{name}/{kind}"] = err
                head, err = _fit({s: v[1] for s, v in by_len.items()})
                if err > FIT_TOLERANCE:
                    fit_error[f"{name}/head"] = err
                (head_saved if ckpt == "none" else head_checkpointed)[f"{act_bytes}/{attention}"] = head
    if used["sdpa"] == "eager":  # transformers fell back: sdpa training runs eager attention
        for act_bytes in ACT_BYTES:
            for ckpt in CHECKPOINTING:
                saved[f"{act_bytes}/sdpa/{ckpt}"] = saved[f"{act_bytes}/eager/{ckpt}"]
            head_saved[f"{act_bytes}/sdpa"] = head_saved[f"{act_bytes}/eager"]
            head_checkpointed[f"{act_bytes}/sdpa"] = head_checkpointed[f"{act_bytes}/eager"]
    result.update(saved=saved, head_saved=head_saved, head_saved_checkpointed=head_checkpointed)
    result["attention_used"] = used
    if fit_error:
        result["fit_error"] = fit_error
    result["seconds"] = round(time.perf_counter() - start, 3)
    return result


def _short_model(
    config: Any, model_type: str, dtype_name: str, attention: str, depth: int, signatures: list[tuple], lists: list[str]
) -> tuple[Any, str]:
    """The model cut (or grown by one layer) to `depth` layers if its first layers keep the full model's signatures,
    else the full model."""
    if depth != len(signatures):
        keep = min(depth, len(signatures))
        try:
            short = _short_config(config, depth, lists)
            model, used = _build_attention(short, model_type, dtype_name, attention)
            layers = decoder_layers(model, model_type)
            if len(layers) == depth and _layer_table(model, short, layers)[0][:keep] == signatures[:keep]:
                return model, used
        except Exception:  # noqa: BLE001 - a config that refuses the cut (validated on assignment): no cut
            pass
        log.info(
            "%s: cannot build %d layers that keep the kinds of its first; measuring all %d",
            model_type,
            depth,
            len(signatures),
        )
    return _build_attention(config, model_type, dtype_name, attention)


def _run(model: Any, layers: Any, seq: int, checkpointing: str, mode: Any, model_type: str) -> tuple[list[int], int]:
    try:
        return saved_bytes(model, layers, 1, seq, checkpointing, mode)
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - model code that needs values (data-dependent routing, .item()) fails
        # here: a limit of the method for this architecture, said in one line (the debug switch shows the cause)
        raise SpecError(
            f"model_type {model_type!r}: cannot run its forward on fake tensors: {_first_line(e)}",
            hint="this architecture needs an analytical model in llmctl.spec.families",
        ) from e
