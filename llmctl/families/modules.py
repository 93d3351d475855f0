"""Where a built transformers model keeps its decoder layers: the one lookup the engine (to checkpoint, compile and
shard them) and the fake-tensor measurement (to measure them) share. Torch is imported only when called."""

from __future__ import annotations

from typing import Any

from llmctl.errors import SpecError

KNOWN_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers", "transformer.layers")
"""Where transformers' causal LMs outside the families keep them (Llama-style, GPT-2, OPT, GPT-NeoX, ...)."""


def _at(model: Any, path: str) -> Any:
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def decoder_layers(model: Any, model_type: str = "") -> Any:
    """The ModuleList of decoder layers: the family's `decoder_path` (by the model's config.model_type), else a known
    path, else the ModuleList of one class that holds the most parameters. SpecError when there is none."""
    import torch

    from llmctl.families import family_of

    mt = model_type or getattr(getattr(model, "config", None), "model_type", "") or ""
    fam = family_of(mt)
    for path in ((fam.decoder_path,) if fam is not None else ()) + KNOWN_PATHS:
        obj = _at(model, path)
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


def outer_units(model: Any, model_type: str = "") -> tuple[Any, list[Any]]:
    """(the input embeddings, [the final norm, the LM head]) of a model whose embeddings and LM head are separate
    parameters, as FSDP units of their own (torchtitan's wrapping); (None, []) when they are tied (one parameter in two
    places must stay in one unit: the root) or not found. The final norm is the last normalization module beside the
    decoder layers (model.norm, transformer.ln_f, gpt_neox.final_layer_norm)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    weights = [getattr(m, "weight", None) for m in (emb, head)]
    if emb is None or head is None or any(w is None for w in weights) or weights[0] is weights[1]:
        return None, []
    layers = decoder_layers(model, model_type)
    parent = next((m for m in model.modules() if any(c is layers for c in m.children())), None)
    norms = [
        c
        for c in (parent.children() if parent is not None else ())
        if "norm" in type(c).__name__.lower() and any(True for _ in c.parameters())
    ]
    return emb, [*norms[-1:], head]
