"""Fixtures shared by test folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def _llmctl_home_for_the_session(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test writes llmctl's per-user state (the job index, llmctl.launch.registry) into the real home: the
    session's fixtures see this folder, and each test gets its own below."""
    import os

    os.environ["LLMCTL_HOME"] = str(tmp_path_factory.getbasetemp() / "llmctl-home-session")


@pytest.fixture(autouse=True)
def _llmctl_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$LLMCTL_HOME of this test (and the processes it starts): a folder of its own, created only when used, so
    that `llmctl status`/`logs` in one test never see another test's jobs."""
    import uuid

    home = tmp_path_factory.getbasetemp() / f"llmctl-home-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("LLMCTL_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def measured_others(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every config of tests/family_configs.py's OTHERS measured on fake tensors once for the session (tens of
    seconds of CPU), by its first `llmctl estimate CONFIG --json` with the CLI's measurer on one cache folder:

    - "cache": the folder (tests/cli/test_measured_cli.py's cache: later runs there are cache hits);
    - "runs": model_type -> (its config.json, that run's Result, the files the run added to the cache);
    - "measured": model_type -> what the measurement (llmctl.measure.fake._measure) returned, before
      measure_config cached it (tests/measure/test_fake.py checks it against the model and the cache file).
    """
    from typer.testing import CliRunner

    from llmctl.cli.main import app
    from llmctl.measure import cache as measure_cache
    from llmctl.measure import fake
    from llmctl.spec import models
    from tests.family_configs import OTHERS

    cache = tmp_path_factory.mktemp("measured")
    folder = tmp_path_factory.mktemp("configs")
    runs: dict[str, Any] = {}
    measured: dict[str, dict] = {}
    measure = fake._measure

    def recorded(cfg: dict, model_type: str, *args: Any) -> dict:
        measured[model_type] = measure(cfg, model_type, *args)
        return measured[model_type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(measure_cache.CACHE_ENV, str(cache))
        mp.setattr(models, "_measurer", [])
        fake.install()  # the CLI's measurer (llmctl.cli.main installs it at import), on `cache`
        mp.setattr(fake, "_measure", recorded)
        for cfg in OTHERS:
            path = folder / cfg["model_type"] / "config.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(cfg))
            before = {p.name for p in cache.iterdir()}
            r = CliRunner().invoke(app, ["estimate", str(path), "--json"])
            runs[cfg["model_type"]] = (path, r, {p.name for p in cache.iterdir()} - before)
    return {"cache": Path(cache), "runs": runs, "measured": measured}
