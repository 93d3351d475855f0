"""Behaviour held fixed across refactors: every case of tests/golden/cases.py gives the recorded `--json` output
(and plan file) figure for figure. A change here is a change of a number a user sees: regenerate on purpose
(`python -m tests.golden.cases`) and say why in the commit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.golden import cases


@pytest.fixture(scope="module")
def measurer(tmp_path_factory: pytest.TempPathFactory):
    """The measured case's model type needs torch (fake tensors); its own cache folder for this module."""
    pytest.importorskip("torch", reason="the measured model type needs torch (pip install 'llmctl[train]')")
    from llmctl.measure import cache, fake
    from llmctl.spec import models

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cache.CACHE_ENV, str(tmp_path_factory.mktemp("golden-cache")))
        mp.setattr(models, "_measurer", [])
        fake.install()
        yield


@pytest.mark.parametrize("name", cases.names())
def test_output_is_unchanged(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if "measured" in name:
        request.getfixturevalue("measurer")
    golden = json.loads((cases.OUTPUTS / f"{name}.json").read_text())
    got = json.loads(json.dumps(cases.run_case(name, tmp_path)))
    assert got["exit_code"] == golden["exit_code"], got["json"]
    assert got["json"] == golden["json"]
    assert got["plan_yaml"] == golden["plan_yaml"]


def test_every_golden_file_is_a_case() -> None:
    assert sorted(p.stem for p in cases.OUTPUTS.glob("*.json")) == sorted(cases.names())
    assert len(cases.names()) >= 12
