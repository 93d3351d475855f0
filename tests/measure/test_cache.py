"""The measurements' cache (llmctl.measure.cache): its key, its folder, and a bad file measured again."""

from __future__ import annotations

import json

import pytest

from llmctl.measure import cache, fake
from tests.family_configs import SMALL

LLAMA = {"model_type": "llama", **SMALL, "num_hidden_layers": 3, "tie_word_embeddings": False}


def measurement(cfg: dict) -> dict:
    """A result of the form measure_config returns (the numbers do not matter here)."""
    result: dict = {k: 0 for k in cache.RESULT_KEYS}
    return result | {
        "version": cache.MEASURE_VERSION,
        "model_type": cfg["model_type"],
        "config_hash": cache.config_hash(cfg),
    }


@pytest.mark.skipif(not fake.available(), reason="measure_config needs torch and transformers (llmctl[train])")
@pytest.mark.parametrize("junk", ["{not json", "", '{"version": 1}', "\udcff"])
def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch, junk):
    result = measurement(LLAMA)
    path = tmp_path / f"{cache.config_hash(LLAMA)}.json"
    path.write_bytes(junk.encode("utf-8", "surrogateescape"))
    calls = []
    monkeypatch.setattr(fake, "_measure", lambda cfg, mt, key, *started: calls.append(mt) or result)
    assert fake.measure_config(LLAMA, cache_dir=tmp_path) == result
    assert calls == ["llama"]
    assert json.loads(path.read_text()) == result
    assert fake.measure_config(LLAMA, cache_dir=tmp_path) == result  # now a cache hit
    assert calls == ["llama"]


def test_the_cache_key_changes_with_the_config_and_the_method(monkeypatch):
    key = cache.config_hash(LLAMA)
    assert cache.config_hash(dict(reversed(list(LLAMA.items())))) == key  # canonical: key order does not matter
    assert cache.config_hash({**LLAMA, "hidden_size": 128}) != key
    monkeypatch.setattr(cache, "MEASURE_VERSION", cache.MEASURE_VERSION + 1)
    assert cache.config_hash(LLAMA) != key


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "here"))
    assert cache.default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("LLMCTL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_cache_dir() == tmp_path / "xdg" / "llmctl" / "measured"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.default_cache_dir() == tmp_path / ".cache" / "llmctl" / "measured"


def test_an_unwritable_cache_costs_a_measurement_not_the_result(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "sub" / "x.json"  # its folder cannot be made: a file is in the way
    cache.write(path, {"a": 1})
    assert cache.read(path, "x") is None
