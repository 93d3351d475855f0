"""The built wheel ships the top-level templates/ as llmctl/templates and the preset data files."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_templates_and_presets(tmp_path):
    pytest.importorskip("hatchling", reason="building the wheel needs hatchling (pip install 'llmctl[dev]')")
    r = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheel = next(tmp_path.glob("llmctl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = [p.relative_to(ROOT).as_posix() for p in (ROOT / "templates").rglob("*") if p.is_file()]
    assert templates, "templates/ is empty"
    for t in templates:
        assert "llmctl/" + t in names, f"{t} is missing from the wheel"
    assert "llmctl/spec/presets/models.yaml" in names and "llmctl/spec/presets/gpus.yaml" in names
