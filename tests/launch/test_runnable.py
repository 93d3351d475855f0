"""`llmctl launch` refuses a plan that would produce nothing (synthetic data, no checkpoint folder) unless told so,
and `--dry-run` warns (issue 25: 32 GPUs trained on random tokens and saved nothing)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from launch_helpers import write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import local

PLAN = (
    "version: 1\nname: t\nmodel:\n  preset: llama-tiny\nhardware:\n  nodes: 1\n  nproc_per_node: 1\n"
    "training:\n  max_steps: 2\n  precision: fp32\n  seq_len: 32\n"
)


def invoke(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMCTL_JOBS_DIR", str(tmp_path / "jobs"))
    # torchrun replaced by a stub that records that it ran: a refused plan never reaches it.
    monkeypatch.setattr(local, "torchrun_command", lambda: [sys.executable, "-c", "open('ran', 'w').write('1')"])
    bindir = tmp_path / "bin"
    bindir.mkdir()
    write_stub(bindir, "sbatch", 'echo ran > sbatch-ran; echo "77;cluster"')
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return tmp_path


def write(here: Path, extra: str = "") -> str:
    (here / "plan.yaml").write_text(PLAN + extra)
    return "plan.yaml"


DATA = "data:\n  kind: text\n  paths: [corpus.txt]\n"
CKPT = "checkpoint:\n  dir: ckpt\n"


@pytest.mark.parametrize("slurm", [[], ["--slurm"]])
def test_synthetic_plan_is_refused_naming_the_fix(here: Path, slurm: list[str]) -> None:
    code, out, err = invoke("launch", write(here, CKPT), *slurm)
    assert code == 2, out + err
    assert "plan.yaml trains on synthetic data" in err and "--data PATH" in err and "--allow-synthetic" in err
    assert len(err.strip().splitlines()) == 1
    assert not (here / "ran").exists() and not (here / "sbatch-ran").exists()


@pytest.mark.parametrize("slurm", [[], ["--slurm"]])
def test_plan_without_checkpoint_is_refused(here: Path, slurm: list[str]) -> None:
    code, out, err = invoke("launch", write(here, DATA), *slurm)
    assert code == 2, out + err
    assert "saves no checkpoint" in err and "--run-dir DIR" in err and "--allow-no-checkpoint" in err
    assert not (here / "ran").exists() and not (here / "sbatch-ran").exists()


def test_allow_flags_let_it_run(here: Path) -> None:
    code, out, err = invoke("launch", write(here), "--allow-synthetic", "--allow-no-checkpoint")
    assert code == 0, out + err
    assert (here / "ran").exists()
    # One flag is not the other: synthetic allowed, the missing checkpoint still refused.
    (here / "ran").unlink()
    code, out, err = invoke("launch", write(here), "--allow-synthetic")
    assert code == 2 and "saves no checkpoint" in err and not (here / "ran").exists()


def test_a_plan_with_data_and_checkpoints_runs_without_flags(here: Path) -> None:
    code, out, err = invoke("launch", write(here, DATA + CKPT))
    assert code == 0, out + err
    assert (here / "ran").exists() and "warning" not in err


@pytest.mark.parametrize("slurm", [[], ["--slurm"]])
def test_dry_run_warns_and_prints(here: Path, slurm: list[str]) -> None:
    code, out, err = invoke("launch", write(here), "--dry-run", *slurm)
    assert code == 0, out + err
    assert "warning: plan.yaml trains on synthetic data" in err
    assert "warning: plan.yaml saves no checkpoint" in err
    assert out.strip()  # the command or script is still printed
    assert not (here / "ran").exists() and not (here / "sbatch-ran").exists()


def test_launch_reads_gpus_like_plan(here: Path) -> None:
    """--gpus and --gpus-per-node mean on launch what they mean on estimate, plan and tune."""
    plan = write(here, DATA + CKPT)
    code, out, err = invoke("launch", plan, "--slurm", "--dry-run", "--gpus", "4", "--gpus-per-node", "2")
    assert code == 0, out + err
    assert "#SBATCH --nodes=2" in out and "LLMCTL_NPROC_PER_NODE=2" in out
    code, out, err = invoke("launch", plan, "--slurm", "--dry-run", "--gpus", "3", "--gpus-per-node", "2")
    assert code == 2 and "--gpus 3 is not a whole number of nodes of 2 GPUs" in err
    code, out, err = invoke("launch", plan, "--slurm", "--dry-run", "--gpus", "2", "--nodes", "2")
    assert code == 2 and "either --gpus or --nodes" in err
