"""Model types outside the analytical families from the command line: `llmctl estimate` and `llmctl plan` on a
config.json that llmctl.measure.fake measures on fake tensors (exact parameter counts, the result cached as
`$LLMCTL_CACHE_DIR/<config_hash>.json`), and the one-line refusals when it cannot (no torch, an unknown type).

Measuring a tiny config costs seconds, so each config is measured once, into one cache folder for the session: the
first `estimate --json` run of each is made by the session's `measured_others` fixture (tests/conftest.py, whose
measurements tests/measure/test_fake.py checks too), and later runs are cache hits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from typer.testing import CliRunner

torch = pytest.importorskip("torch", reason="measuring a model type needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip(
    "transformers", reason="measuring a model type needs transformers (pip install 'llmctl[train]')"
)

from llmctl.cli.main import app  # noqa: E402
from llmctl.measure import cache as measure_cache  # noqa: E402
from llmctl.measure import fake as fm  # noqa: E402
from llmctl.spec import models  # noqa: E402
from llmctl.spec.planfile import load_plan  # noqa: E402
from tests.family_configs import OTHER_MOE, OTHERS, SMALL  # noqa: E402

runner = CliRunner()
IDS = [c["model_type"] for c in OTHERS]


def run(*args: str) -> Result:
    return runner.invoke(app, list(args))


def lines(r: Result) -> list[str]:
    return [x for x in r.output.splitlines() if x.strip()]


def write_config(folder: Path, cfg: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def meta_params(cfg: dict[str, Any]) -> int:
    """The parameter count of transformers' own causal LM for `cfg`, built on the meta device (tied weights once)."""
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def use_measurer(mp: pytest.MonkeyPatch, cache: Path) -> None:
    """The CLI's measurer (installed by llmctl.cli.main at import, as here; restored after the test) on `cache`."""
    mp.setenv(measure_cache.CACHE_ENV, str(cache))
    mp.setattr(models, "_measurer", [])
    fm.install()


def no_measuring(*args: Any, **kwargs: Any) -> dict:
    raise AssertionError("measured again: the cache was not used")


@pytest.fixture(scope="module")
def cache(measured_others: dict[str, Any]) -> Path:
    return measured_others["cache"]


@pytest.fixture(autouse=True)
def measurer(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_measurer(monkeypatch, cache)


@pytest.fixture(scope="module")
def first_runs(measured_others: dict[str, Any]) -> dict[str, tuple[Path, Result, set[str]]]:
    """model_type -> (its config.json, its first `llmctl estimate CONFIG --json`, the files that run added to the
    cache), for every config of OTHERS: each measured once for the whole session."""
    return measured_others["runs"]


# --- estimate: measured once, then from the cache ----------------------------------------------------------------
@pytest.mark.parametrize("cfg", OTHERS, ids=IDS)
def test_estimate_measures_a_type_outside_the_families(first_runs, cfg, cache, monkeypatch):
    path, r, added = first_runs[cfg["model_type"]]
    assert r.exit_code == 0, r.output
    assert f"measuring model_type {cfg['model_type']!r} on fake tensors" in r.stderr  # says what takes the seconds
    data = json.loads(r.stdout)
    assert data["params"] == meta_params(cfg)
    assert data["measured"] is True and "measured on fake tensors" in data["shape"]
    key = measure_cache.config_hash(cfg)
    assert added == {f"{key}.json"}
    cached = json.loads((cache / f"{key}.json").read_text())
    assert cached["model_type"] == cfg["model_type"] and cached["total_params"] == data["params"]

    # A second run is a cache hit: nothing measured, nothing announced, the same estimate.
    monkeypatch.setattr(fm, "_measure", no_measuring)
    again = run("estimate", str(path), "--json")
    assert again.exit_code == 0, again.output
    assert "measuring" not in again.stderr
    assert json.loads(again.stdout) == data
    human = run("estimate", str(path))
    assert human.exit_code == 0, human.output
    assert f"{data['params']:,} parameters" in human.output
    assert "measured on fake tensors" in human.output
    assert {p.name for p in cache.iterdir()} >= added


def test_estimate_of_an_moe_type_outside_the_families(tmp_path):
    r = run("estimate", str(write_config(tmp_path, OTHER_MOE)), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["measured"] is True
    total, active = data["params"], data["active_params_per_token"]
    assert total == meta_params(OTHER_MOE)
    assert 0 < active < total
    # Per token each MoE layer uses k of its E experts: what the measurement says, layer kind by kind.
    m = fm.measure_config(OTHER_MOE)  # a cache hit
    assert m["total_params"] == total
    assert active == total - sum((k["params"] - k["active_params"]) * k["count"] for k in m["layers"])


# --- plan --------------------------------------------------------------------------------------------------------
def test_plan_on_a_measured_type_writes_a_plan(first_runs, tmp_path, monkeypatch):
    path, _, _ = first_runs["granite"]
    monkeypatch.setattr(fm, "_measure", no_measuring)  # the estimate's measurement, from the cache
    out = tmp_path / "plan.yaml"
    r = run("plan", str(path), "--gpu", "A100-80GB", "--gpus-per-node", "2", "--seq-len", "512", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert f"plan written to {out}" in r.output
    plan = load_plan(out)
    assert plan.model.config == str(path)
    assert plan.hardware.gpu == "A100-80GB" and plan.hardware.nproc_per_node == 2 and plan.training.seq_len == 512


# --- one-line refusals -------------------------------------------------------------------------------------------
def test_without_torch_a_measured_type_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(measure_cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(fm, "available", lambda: False)
    for args in (["estimate"], ["estimate-memory"], ["plan", "--gpu", "A100-80GB"]):
        r = run(*args, str(write_config(tmp_path, OTHERS[0])))
        assert r.exit_code == 2, r.output
        assert len(lines(r)) == 1 and lines(r)[0].startswith("llmctl: error: "), r.output
        assert "'granite'" in r.output and "llmctl[train]" in r.output
        assert "Traceback" not in r.output
    assert not (tmp_path / "cache").exists()


NOT_A_MODEL = {"model_type": "notamodel", **SMALL, "num_hidden_layers": 2}


def test_an_unknown_model_type_is_one_line(tmp_path, cache):
    before = sorted(cache.iterdir())
    r = run("estimate", str(write_config(tmp_path, NOT_A_MODEL)))
    assert r.exit_code == 2, r.output
    # One line: the measurer announces itself only once transformers has accepted the config.
    assert len(lines(r)) == 1 and lines(r)[0].startswith("llmctl: error: "), r.output
    assert "'notamodel'" in r.output and "does not know it" in r.output
    assert "Traceback" not in r.output
    assert sorted(cache.iterdir()) == before  # nothing cached
