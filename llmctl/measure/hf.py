"""A transformers causal LM built on the meta device and read: its decoder layers, their kinds, its parameter counts.

For llmctl.measure.fake. Decoder layers are grouped into kinds by (class, parameter names and shapes, attention
type: layer attributes such as attention_type / sliding_window and per-layer config lists such as layer_types).
torch and transformers are imported inside functions: importing this module stays cheap.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

from llmctl.errors import SpecError, suggest
from llmctl.spec.attention import Attention

# Where common families keep their decoder layers; else the largest ModuleList of one class is taken.
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


def model_type_of(cfg: Any) -> str:
    """cfg["model_type"] of a config.json's contents; SpecError when cfg is not an object or has none."""
    if not isinstance(cfg, dict):
        raise SpecError(f"a model config is a JSON object with model_type, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise SpecError("the model config has no model_type", hint='config.json names it, e.g. "model_type": "llama"')
    return mt


def first_line(e: BaseException) -> str:
    """The exception in one line: its first line, and the second when the first only introduces it (huggingface_hub's
    "Class validation error for validator 'validate_architecture':")."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def hf_config(cfg: dict, model_type: str) -> Any:
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
        raise SpecError(f"model_type {model_type!r}: transformers rejects the config: {first_line(e)}") from None
    config.use_cache = False
    return config


def build(config: Any, model_type: str, dtype_name: str, attention: str | None = None) -> Any:
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
        raise SpecError(f"model_type {model_type!r}: transformers cannot build a causal LM: {first_line(e)}") from e
    model.config.use_cache = False
    return model


def build_attention(config: Any, model_type: str, dtype_name: str, attention: str) -> tuple[Any, str]:
    """(model, attention transformers used): a model without sdpa support is built with eager."""
    try:
        model = build(config, model_type, dtype_name, attention)
    except SpecError:
        if Attention(attention).keeps_scores:  # eager has nothing to fall back to
            raise
        model = build(config, model_type, dtype_name, "eager")
    return model, str(getattr(model.config, "_attn_implementation", None) or attention)


def config_value(config: Any, name: str) -> Any:
    """config.name, or None when reading it fails (some configs refuse global reads of per-layer values)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a property of someone else's config class
        return None


def _per_layer_lists(config: Any, num_layers: int) -> list[str]:
    """Config attributes that are lists with one entry per layer (layer_types, no_rope_layers, ...)."""
    names = []
    for name in sorted(config.to_dict()):
        value = config_value(config, name)
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


def kind_ids(signatures: list[tuple]) -> dict[tuple, str]:
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


def text_config(config: Any) -> Any:
    """The config that describes the decoder: `text_config` of a multimodal config (Gemma 4, Qwen3.5), else itself."""
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001 - older transformers, or a config class without text/sub-config logic
        return config


def layer_table(model: Any, config: Any, layers: Any) -> tuple[list[tuple], list[str]]:
    text = text_config(config)
    lists = _per_layer_lists(text, len(layers))
    return [_signature(layer, i, text, lists) for i, layer in enumerate(layers)], lists


def short_config(config: Any, n: int, lists: list[str]) -> Any:
    """The config cut to its first n layers, per-layer lists cut to match; n past the depth repeats the lists from
    their start (a model one layer deeper than the real one, whose first layers are the real ones)."""
    short = copy.deepcopy(config)
    text = text_config(short)  # the same object as the copy's text_config: cutting it cuts the copy
    text.num_hidden_layers = n
    for name in lists:
        value = getattr(text, name)
        setattr(text, name, type(value)(value[i % len(value)] for i in range(n)))
    return short


def param_counts(model: Any, layers: Any, kinds: list[str], config: Any) -> dict[str, Any]:
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
    k = k or config_value(text_config(config), "num_experts_per_tok")
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
