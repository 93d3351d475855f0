"""Model config overrides with RoPE spelled once (torch-free).

transformers 5 reads a config's rotary settings from `rope_scaling` (the 4.x key, still in the hub's Llama 3.1 files)
before `rope_parameters` (the key it writes, with `rope_theta` inside), and takes the theta from the top-level
`rope_theta` or from inside that dict. Applying `model.overrides` key by key then goes wrong two ways: a
`rope_scaling` override on a transformers-5 config (theta inside `rope_parameters`, no top-level `rope_theta`) drops
the theta, so the model silently gets transformers' default 10,000 (Llama 3 uses 500,000); and a `rope_parameters`
override is ignored where the base config still has `rope_scaling`. `merge_overrides` is the one merge the plan
file, the engine's build and `llmctl export` use.
"""

from __future__ import annotations

from typing import Any

ROPE_KEYS = ("rope_scaling", "rope_parameters")


def _flat(d: Any) -> bool:
    """A single rotary dict (rope_type, factor, ...), not Gemma 3's dict per layer type."""
    return isinstance(d, dict) and not any(isinstance(v, dict) for v in d.values())


def base_theta(config: dict[str, Any]) -> Any:
    """The rotary base a config declares: inside its rope dict (transformers 5) or at its top level (4.x)."""
    for key in ROPE_KEYS:
        d = config.get(key)
        if _flat(d) and d.get("rope_theta") is not None:
            return d["rope_theta"]
    return config.get("rope_theta")


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` applied. When the overrides name `rope_scaling` or `rope_parameters`, both spellings
    are replaced by one `rope_parameters` (`null` means plain RoPE) that keeps the theta: the override's own
    `rope_theta`, else its dict's, else the base config's. A dict per layer type (Gemma 3) is passed as it is."""
    out = {**base, **overrides}
    named = [k for k in ROPE_KEYS if k in overrides]
    if not named:
        return out
    given = overrides["rope_parameters"] if "rope_parameters" in named else overrides["rope_scaling"]
    for key in ROPE_KEYS:
        out.pop(key, None)
    if given is not None and not _flat(given):
        out["rope_parameters"] = given
        return out
    params = dict(given or {"rope_type": "default"})
    if "rope_type" not in params and "type" in params:  # the oldest spelling ({"type": "linear", ...})
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    theta = overrides.get("rope_theta", params.get("rope_theta", base_theta(base)))
    if theta is not None:
        params["rope_theta"] = theta
    out["rope_parameters"] = params
    return out
