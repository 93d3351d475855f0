"""A plan-only GPU kind (the catalog's plan_only: Intel Gaudi 3, which llmctl's engine does not target): `llmctl plan`
plans for it and says so in one note line; `llmctl launch` of its plan is refused in one line with exit 2, before
anything is rendered or run. Kinds the engine runs, and kinds this machine's catalog does not know, launch as before."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.spec import hardware

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gaudi_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    r = CliRunner().invoke(app, ["plan", "llama-tiny", "--gpu", "gaudi3", "--gpus", "1", "-o", "plan.yaml"])
    assert r.exit_code == 0, r.output
    return tmp_path / "plan.yaml"


def test_plan_notes_a_plan_only_kind_in_one_line(gaudi_plan: Path) -> None:
    reason = hardware.resolve_gpu("Gaudi-3").plan_only
    assert reason and "habana_frameworks" in reason
    r = CliRunner().invoke(app, ["plan", "llama-tiny", "--gpu", "Gaudi-3", "--gpus", "1", "--no-write"])
    assert r.exit_code == 0, r.output
    notes = [line for line in r.output.splitlines() if line.startswith("note:")]
    assert notes == [f"note: Gaudi-3 is plan-only: {reason}; `llmctl launch` refuses it"]
    # a kind the engine runs has no such note
    r = CliRunner().invoke(app, ["plan", "llama-tiny", "--gpu", "A100-80GB", "--gpus", "1", "--no-write"])
    assert r.exit_code == 0 and "plan-only" not in r.output
    assert "gpu: Gaudi-3" in gaudi_plan.read_text()  # the plan file is still written


@pytest.mark.parametrize("extra", [[], ["--dry-run"], ["--slurm", "--dry-run"]])
def test_launch_refuses_a_plan_for_a_plan_only_kind(gaudi_plan: Path, extra: list[str]) -> None:
    r = CliRunner().invoke(app, ["launch", str(gaudi_plan), "--allow-synthetic", "--allow-no-checkpoint", *extra])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "is a plan for Gaudi-3, which llmctl's engine cannot run" in lines[0]
    assert "habana_frameworks" in lines[0] and "--gpu KIND" in lines[0]
    assert not (gaudi_plan.parent / "llmctl-jobs").exists() and "torchrun" not in r.output  # nothing ran


@pytest.mark.parametrize("gpu", ["A100-80GB", "MI355X", "SomeFutureGPU"])
def test_launch_of_other_kinds_is_not_refused(
    gaudi_plan: Path, gpu: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA and ROCm kinds launch; a kind of the site's own launches once its catalog file names it (a kind nobody
    knows is refused when the plan is read: tests/launch/test_injection.py)."""
    if gpu == "SomeFutureGPU":
        import yaml

        shipped = yaml.safe_load((REPO / "llmctl/spec/presets/gpus.yaml").read_text())
        entry = {**next(e for e in shipped if e["name"] == "H100-SXM"), "name": gpu, "aliases": []}
        catalog = tmp_path / "gpus.yaml"
        catalog.write_text(yaml.safe_dump([entry]))
        monkeypatch.setenv("LLMCTL_GPU_CATALOG", str(catalog))
    text = gaudi_plan.read_text()
    gaudi_plan.write_text(text.replace("gpu: Gaudi-3", f"gpu: {gpu}"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(64))))  # the GPUs it asks for are here
    r = CliRunner().invoke(app, ["launch", str(gaudi_plan), "--dry-run", "--allow-synthetic", "--allow-no-checkpoint"])
    assert r.exit_code == 0, r.output
    assert "torchrun" in r.output and "cannot run" not in r.output
