"""Issue 49: a GPU plan launched on a machine without its GPUs is one line and exit 2 before torchrun starts
(never a ChildFailedError traceback, never a silent CPU run); --dry-run says the same; a CPU plan still runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launch_helpers import minimal_plan_yaml, write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import local


def _plan(tmp_path: Path, gpu: str | None, nproc: int = 2) -> Path:
    text = minimal_plan_yaml(nproc=nproc).replace("hardware:\n", f"hardware:\n  gpu: {gpu or 'null'}\n")
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def no_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """torchrun replaced by a stub that records it was started (it must not be, for a refused plan)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    marker = tmp_path / "torchrun-started"
    write_stub(bindir, "torchrun", f"touch {str(marker)!r}")
    monkeypatch.setattr(local, "torchrun_command", lambda: [str(bindir / "torchrun")])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMCTL_JOBS_DIR", str(tmp_path / "jobs"))
    return marker


@pytest.mark.parametrize(("visible", "seen"), [("", "no GPU visible"), ("0", "1 GPU visible")])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_gpu_plan_without_its_gpus_is_one_line(tmp_path, monkeypatch, no_torchrun, visible, seen, dry_run):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    plan = _plan(tmp_path, "H100")
    r = CliRunner().invoke(app, ["launch", str(plan), *(["--dry-run"] if dry_run else [])])
    assert r.exit_code == 2, r.output
    assert f"the plan is for 2 H100 GPUs per node and this machine has {seen}" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not no_torchrun.exists() and not (tmp_path / "checkpoints").exists()


def test_enough_visible_gpus_pass_the_check(tmp_path, monkeypatch, no_torchrun):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    r = CliRunner().invoke(app, ["launch", str(_plan(tmp_path, "H100")), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "torchrun" in r.output


def test_a_cpu_plan_is_not_asked_for_gpus(tmp_path, monkeypatch, no_torchrun):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = CliRunner().invoke(app, ["launch", str(_plan(tmp_path, None)), "--dry-run"])
    assert r.exit_code == 0, r.output


def test_visible_gpus_reads_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,-1")
    assert local.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert local.visible_gpus() == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", os.devnull)  # no nvidia-smi anywhere
    assert local.visible_gpus() == 0
