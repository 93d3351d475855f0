"""The launcher interface: a backend added through the registry alone is usable by `launch --executor`,
`--dry-run`, `status`, `logs` and `cancel`; local runs have a status and can be cancelled; submitit's version
range is the one pyproject pins."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from launch_helpers import REPO, minimal_plan_yaml
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import InputError
from llmctl.launch import backends, jobs, local
from llmctl.launch.backends import Job, LaunchBackend


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


class EchoBackend(LaunchBackend):
    """A backend that 'submits' by writing the job's command into its folder: nothing llmctl knows by name."""

    name = "echo-test"
    help = "test backend"
    cancelled: ClassVar[list[str]] = []

    def render(self, job: Job) -> str:
        return f"echo-run {job.name} nodes={job.nodes} nproc={job.nproc_per_node} plan={job.plan_path}\n"

    def submit(self, job: Job) -> jobs.JobRecord:
        folder = job.new_folder()
        (folder / "echo.log").write_text(self.render(job))
        record = job.record(self.name, "echo-1", folder, [folder / "echo.log"], ["echo-run"])
        record.save()
        return record

    def state(self, record: jobs.JobRecord) -> str:
        return "CANCELLED" if record.job_id in self.cancelled else "RUNNING"

    def cancel(self, record: jobs.JobRecord) -> None:
        self.cancelled.append(record.job_id)


@pytest.fixture
def echo_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    backends.register_backend(EchoBackend())
    EchoBackend.cancelled.clear()
    (tmp_path / "plan.yaml").write_text(minimal_plan_yaml(name="echo", nodes=1, nproc=3))
    yield tmp_path
    backends.unregister_backend(EchoBackend.name)


def test_a_backend_registered_alone_dry_runs_and_runs(echo_backend: Path) -> None:
    code, out = invoke("launch", "plan.yaml", "--executor", "echo-test", "--dry-run")
    assert code == 0, out
    assert out == "echo-run echo nodes=1 nproc=3 plan=plan.yaml\n"
    assert not (echo_backend / "llmctl-jobs").exists()  # a dry run creates nothing

    code, out = invoke("launch", "plan.yaml", "--executor", "echo-test", "--nodes", "2", "--nproc-per-node", "1")
    assert code == 0, out
    assert "submitted job echo-1 (echo-test, 2 nodes x 1 processes)" in out
    code, out = invoke("status", "echo-1")
    assert code == 0 and "echo-test" in out and "RUNNING" in out, out
    code, out = invoke("logs", "echo-1")
    assert code == 0 and out == "echo-run echo nodes=2 nproc=1 plan=plan.yaml\n", out
    code, out = invoke("cancel", "echo-1")
    assert code == 0 and EchoBackend.cancelled == ["echo-1"], out
    assert "CANCELLED" in invoke("status", "echo-1")[1]


def test_unknown_executor_lists_the_registered_ones(echo_backend: Path) -> None:
    code, out = invoke("launch", "plan.yaml", "--executor", "pbs", "--dry-run")
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert "local, sbatch, submitit, echo-test" in out


def test_slurm_options_need_a_slurm_backend(echo_backend: Path) -> None:
    code, out = invoke("launch", "plan.yaml", "--executor", "echo-test", "--partition", "gpu", "--dry-run")
    assert code == 2 and "--partition only apply with --slurm" in out, out
    code, out = invoke("launch", "plan.yaml", "--slurm", "--executor", "echo-test", "--dry-run")
    assert code == 2 and "does not submit to SLURM" in out, out


def test_status_of_a_job_whose_backend_is_not_registered(echo_backend: Path) -> None:
    assert invoke("launch", "plan.yaml", "--executor", "echo-test")[0] == 0
    backends.unregister_backend(EchoBackend.name)
    code, out = invoke("status")
    assert code == 0 and "not registered" in out, out
    code, out = invoke("cancel", "echo-1")
    assert code == 2 and "'echo-test'" in out and len(out.strip().splitlines()) == 1, out


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(local.LocalBackend())


def test_local_cancel_falls_back_to_torchrun_when_no_rank_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose ranks never catch SIGTERM (none started, or stuck importing): after the wait, cancel signals
    torchrun itself; with the launching llmctl gone too, cancel records the end in events. (The usual path, ranks
    that checkpoint: tests/launch/test_jobs_registry.py.)"""
    monkeypatch.setattr(local, "RANKS_READY_WAIT_S", 0.5)
    monkeypatch.setattr(local, "LAUNCHER_LINE_WAIT_S", 0.5)
    (tmp_path / "plan.yaml").write_text(minimal_plan_yaml(name="sleepy"))
    torchrun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    reaper = threading.Thread(target=torchrun.wait, daemon=True)  # as the launching llmctl would
    reaper.start()
    try:
        record = jobs.JobRecord(
            f"local-{torchrun.pid}", "local", str(tmp_path), "sleepy", 1, 2, "2026-01-01T00:00:00Z", pid=torchrun.pid
        )
        record.host, record.pid_start = socket.gethostname(), local._process_start(torchrun.pid)
        backend = local.LocalBackend()
        assert backend.state(record) == "RUNNING"
        message = backend.cancel(record)
        assert torchrun.wait(timeout=10) == -signal.SIGTERM
        assert message == f"job {record.job_id} cancelled: no checkpoint (the plan has no checkpoint.dir)"
        lines = (tmp_path / "events").read_text().splitlines()
        assert [ln.split()[0] for ln in lines] == ["cancel-requested", "cancelled"]
        assert backend.state(record) == "CANCELLED"
        with pytest.raises(InputError, match="is not running"):
            backend.cancel(record)
    finally:
        if torchrun.poll() is None:
            torchrun.kill()


def test_submitit_version_is_the_pinned_range() -> None:
    """pyproject's `slurm` extra pins the range whose private names (_make_sbatch_string, USR_SIG) the submitit
    backend uses; the installed submitit is in that range and has them."""
    submitit = pytest.importorskip("submitit", reason="submitit is not installed (pip install 'llmctl[slurm]')")
    from submitit.slurm import slurm

    from llmctl.launch.submitit_backend import SUPPORTED_VERSIONS

    slurm_extra = re.search(r"^slurm = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert slurm_extra and f'"submitit{SUPPORTED_VERSIONS}"' in slurm_extra.group(1)
    lo, hi = re.fullmatch(r">=([\d.]+),<([\d.]+)", SUPPORTED_VERSIONS).groups()  # type: ignore[union-attr]

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:3])

    assert key(lo) <= key(submitit.__version__) < key(hi), submitit.__version__
    assert callable(slurm._make_sbatch_string) and hasattr(slurm.SlurmJobEnvironment, "USR_SIG")
