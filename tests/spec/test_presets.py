"""Every preset's parameter count equals what transformers instantiates (meta device) and the published count."""

import math
import re

import pytest

from llmctl.errors import SpecError, UnknownNameError
from llmctl.spec import models

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")


def build_meta(cfg: dict):
    cfg = dict(cfg)
    mt = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(mt, **cfg)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def meta_active(model, spec) -> int:
    """Parameters a token passes through, counted on the built model: every parameter, minus, in each MoE block,
    the routed experts' share it is not sent to ((E - k) / E of the 3-D expert tensors and their biases)."""
    total = sum(p.numel() for p in model.parameters())
    for layer, block in zip(spec.layers, models_layers(model)):
        m = layer.mlp
        if m.moe:
            experts = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
            total -= experts * (m.num_experts - m.experts_per_token) // m.num_experts
    return total


def models_layers(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def rounded(text: str) -> tuple[float, float]:
    """'30.5B' -> (30.5e9, half a unit of the last digit): a model card's figure and its rounding."""
    m = re.fullmatch(r"([0-9]+)(?:\.([0-9]+))?B", text)
    assert m, text
    decimals = len(m.group(2) or "")
    return float(text[:-1]) * 1e9, 0.5 * 10 ** (9 - decimals)


@pytest.mark.parametrize("name", models.preset_names())
def test_param_count_equals_transformers(name):
    entry = models.preset_entry(name)
    model = build_meta(entry["config"])
    expected = sum(p.numel() for p in model.parameters())
    spec = models.from_preset(name)
    assert spec.params == expected
    assert spec.active_params_per_token == meta_active(model, spec)
    if "published_params" in entry:
        assert spec.params == entry["published_params"]
    if "published" in entry:
        value, half_unit = rounded(str(entry["published"]))
        assert abs(spec.params - value) <= half_unit, (spec.params, entry["published"])
    if "published_active" in entry:
        # Vendors count "active" with or without the input embedding (a lookup, not a matmul): one must match.
        value, _ = rounded(str(entry["published_active"]))
        candidates = (spec.active_params_per_token, spec.active_params_per_token - spec.embedding_params)
        assert min(abs(c - value) / value for c in candidates) < 0.05, (candidates, value)
    # Per-layer tensors: the shapes we list are the shapes transformers builds (order-free), for every block.
    for index, block in enumerate(models_layers(model)):
        assert sorted(math.prod(p.shape) for p in block.parameters()) == sorted(
            math.prod(s) for _, s in spec.layer_tensors(index)
        ), index


def test_new_families_have_presets_with_hub_ids():
    """The issue's list of published sizes: each is a preset with a hub id, found by name and by hub id."""
    wanted = (
        *("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b"),
        *("qwen3-235b-a22b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "gemma-2-9b", "gemma-2-27b"),
        *("llama-3.2-1b", "llama-3.2-3b", "llama-3.3-70b", "llama-4-scout", "llama-4-maverick", "deepseek-v3"),
        *("deepseek-r1", "gpt-oss-20b", "gpt-oss-120b", "olmo-2-7b", "olmo-2-13b", "olmo-2-32b", "phi-3.5-mini"),
        *("phi-4", "mistral-nemo-12b", "smollm3-3b"),
    )
    for name in wanted:
        entry = models.preset_entry(name)
        assert entry["hf_id"].count("/") == 1
        assert models.resolve_model(entry["hf_id"]).params == models.from_preset(name).params
        assert any(k in entry for k in ("published", "published_params", "published_active")) or name.startswith(
            "gemma-3-"
        ), name


def test_local_config_json_file_and_folder(tmp_path):
    import json

    cfg = models.preset_entry("mistral-7b")["config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = models.resolve_model(str(tmp_path))
    b = models.resolve_model(str(tmp_path / "config.json"))
    assert a.params == b.params == 7_241_732_096


def test_malformed_and_unsupported_configs(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(SpecError, match="is not valid JSON"):
        models.resolve_model(str(bad))
    bad.write_text('{"model_type": "t5", "d_model": 512}')  # no analytical model; measured, but not a causal LM
    with pytest.raises(SpecError, match="t5"):
        models.resolve_model(str(bad))
    bad.write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(SpecError, match="missing field"):
        models.resolve_model(str(bad))


def test_unknown_model_suggests_close_names():
    with pytest.raises(UnknownNameError) as e:
        models.resolve_model("llama2-7b")
    assert "llama-2-7b" in str(e.value)


def test_params_count_shape():
    spec = models.resolve_model(params="7B")
    assert spec.params == 7_000_000_000
    assert spec.source == "params"
    # The assumed Llama-2-like shape lands within 10% of the stated count (it only drives activations).
    assert abs(spec.shape_params - 7e9) / 7e9 < 0.10
    assert spec.hidden_size == 128 * spec.num_layers
    with pytest.raises(SpecError):
        models.parse_count("-3B")
    with pytest.raises(SpecError):
        models.parse_count("seven")
    assert models.parse_count("350M") == 350_000_000
    assert models.parse_count("1.5e9") == 1_500_000_000
