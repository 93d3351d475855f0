"""Every preset's parameter count equals what transformers instantiates (meta device) and the published count."""

import math

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


@pytest.mark.parametrize("name", models.preset_names())
def test_param_count_equals_transformers(name):
    entry = models.preset_entry(name)
    model = build_meta(entry["config"])
    expected = sum(p.numel() for p in model.parameters())
    spec = models.from_preset(name)
    assert spec.params == expected
    if "published_params" in entry:
        assert spec.params == entry["published_params"]
    # Per-layer tensors: the shapes we list are the shapes transformers builds (order-free).
    layer = dict(model.model.layers[0].named_parameters()) if hasattr(model, "model") else None
    if layer is not None:
        assert sorted(math.prod(p.shape) for p in layer.values()) == sorted(
            math.prod(s) for _, s in spec.layer_tensors()
        )


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
    bad.write_text('{"model_type": "t5", "d_model": 512}')
    with pytest.raises(SpecError, match="not supported"):
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
