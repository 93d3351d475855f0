"""A run owns its folder (issue 46): an flock on `<run folder>/.llmctl-run.lock`, held by `llmctl launch` (local)
or the engine's rank 0, for the run's life. A second launch on the folder gets one line naming the job, pid and
host that hold it, exit 2, and writes nothing; once the holder is gone (even killed: the kernel drops its flock) a
launch proceeds. Before, two launches of one plan shared the folder: a traceback in the shared temporary checkpoint
folder, two start events and a duplicate step in metrics.jsonl.

No torchrun: another process holds the lock as a run would, and a stub stands for torchrun."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_helpers import minimal_plan_yaml, write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import local, runlock

HOLD = """
import sys, time
from llmctl.launch import runlock
lock = runlock.acquire(runlock.run_folders(sys.argv[1], None), job=sys.argv[2])
print("held", flush=True)
time.sleep(300)
"""


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    monkeypatch.delenv(runlock.HELD_ENV, raising=False)
    (tmp_path / "plan.yaml").write_text(minimal_plan_yaml() + "logging:\n  dir: run\n")
    return tmp_path


@pytest.fixture
def holder(workdir: Path) -> Iterator[subprocess.Popen]:
    """Another process holding the run folder's lock, as a running launch does (job local-4242)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir / "run"), "local-4242"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def stub_torchrun(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """torchrun replaced by a command that records that it ran and the lock variable the ranks would see."""
    started = workdir / "started.json"
    code = f"import json, os; json.dump(dict(os.environ), open({str(started)!r}, 'w'))"
    monkeypatch.setattr(local, "torchrun_command", lambda: [sys.executable, "-c", code])
    return started


def test_a_second_launch_is_one_line_exit_2_until_the_holder_is_gone(
    workdir: Path, holder: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = stub_torchrun(workdir, monkeypatch)
    lock_file = workdir / "run" / runlock.LOCK_FILE
    before = {p: p.read_bytes() for p in (workdir / "run").iterdir()}

    result = CliRunner().invoke(app, ["launch", "plan.yaml"])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    line = result.output.strip()
    assert line.startswith(f"llmctl: error: run folder {workdir / 'run'} is in use by job local-4242 ")
    assert f"(pid {holder.pid} on host {socket.gethostname()}, since " in line
    assert not started.exists(), "torchrun ran"
    assert not (workdir / "llmctl-jobs").exists(), "a job folder was made"
    assert {p: p.read_bytes() for p in (workdir / "run").iterdir()} == before, "the holder's files were touched"

    holder.send_signal(signal.SIGKILL)  # dies without a word: its lock file stays, its flock goes
    holder.wait()
    assert lock_file.exists()
    result = CliRunner().invoke(app, ["launch", "plan.yaml"])
    assert result.exit_code == 0, result.output
    env = json.loads(started.read_text())
    assert env[runlock.HELD_ENV] == str(os.getpid())  # the ranks know the launcher holds it
    record = json.loads(lock_file.read_text())  # rewritten by the new holder, with the job it started
    assert record["pid"] == os.getpid() and record["job"].startswith("local-")


def test_the_checkpoint_folder_outside_the_run_folder_is_locked_too(workdir: Path) -> None:
    assert runlock.run_folders("run", "run/checkpoints") == [workdir / "run"]
    assert runlock.run_folders("run", "ckpt") == [workdir / "run", workdir / "ckpt"]
    held = runlock.acquire([workdir / "ckpt"], job="12345")
    try:
        with pytest.raises(runlock.RunFolderBusy, match=r"run folder .*ckpt is in use by job 12345 \(pid "):
            runlock.acquire(runlock.run_folders("run", "ckpt"))
        assert _unlocked(workdir / "run")  # the lock taken before the refusal is let go
    finally:
        held.release()


def _unlocked(folder: Path) -> bool:
    fd = os.open(folder / runlock.LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_the_engine_rank_0_locks_unless_the_launcher_holds_it(
    workdir: Path, holder: subprocess.Popen, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SLURM job's (or a hand-typed torchrun's) rank 0 refuses a held folder in one line, exit 2, before torch."""
    from llmctl.engine.__main__ import main

    monkeypatch.setenv("RANK", "0")
    assert main(["plan.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("llmctl: error: run folder ") and "is in use by job local-4242" in err
    assert len(err.splitlines()) == 1
    assert runlock.for_engine("run", None, rank=1) is None  # the other ranks take none
    monkeypatch.setenv(runlock.HELD_ENV, str(holder.pid))  # the launching llmctl holds it for the run
    assert runlock.for_engine("run", None, rank=0) is None


def test_a_file_system_that_cannot_lock_warns_and_runs(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = runlock.acquire([workdir / "run"])
    assert lock.files == {} and lock.warnings == [
        f"run folder {workdir / 'run'}: the file system cannot lock (No locks available); not locked"
    ]


def test_the_engine_lets_go_when_its_run_ends(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held while the run runs, released when it returns or fails: tests/engine/engine_runs.py runs plans one after
    another in one process, a resume among them on the same folder."""
    from llmctl.engine import __main__ as engine_main
    from llmctl.spec.planfile import load_plan

    seen: list[bool] = []

    def run(plan: object) -> None:
        seen.append(_unlocked(workdir / "run"))
        if len(seen) == 2:
            raise RuntimeError("a failed run")

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("llmctl.engine.loop.run", run)
    load_plan(workdir / "plan.yaml")  # a valid plan: what main runs is the run below
    assert engine_main.main([str(workdir / "plan.yaml")]) == 0
    with pytest.raises(RuntimeError):
        engine_main.main([str(workdir / "plan.yaml")])
    assert seen == [False, False] and _unlocked(workdir / "run")


@pytest.fixture
def fake_sbatch(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch prints job 123 (and counts its calls); squeue answers with the state in `squeue-state`."""
    bindir = workdir / "fakebin"
    bindir.mkdir()
    (workdir / "squeue-state").write_text("PENDING\n")
    write_stub(bindir, "sbatch", f'echo x >> {str(workdir / "sbatch-calls")!r}; echo "123;cluster"')
    write_stub(bindir, "squeue", f"cat {str(workdir / 'squeue-state')!r}")
    for name in ("sacct", "scontrol"):
        write_stub(bindir, name, "exit 1")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return workdir / "sbatch-calls"


def _submit(workdir: Path) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["launch", str(workdir / "plan.yaml"), "--slurm", "--no-preflight"])
    return r.exit_code, r.output


def test_a_slurm_submission_refuses_a_folder_a_run_holds(workdir: Path, holder, fake_sbatch: Path) -> None:
    """Issue 46: the check at submission, not hours later when the job starts and its rank 0 finds the lock."""
    code, out = _submit(workdir)
    assert code == 2, out
    assert f"run folder {workdir / 'run'} is in use by job local-4242" in out
    assert not fake_sbatch.exists() and not (workdir / "llmctl-jobs").exists()  # nothing submitted or written


def test_a_second_submission_refuses_the_folder_of_a_queued_job(workdir: Path, fake_sbatch: Path) -> None:
    code, out = _submit(workdir)
    assert code == 0 and "submitted job 123" in out, out
    code, out = _submit(workdir)  # job 123 is PENDING: it owns the folder though it holds no lock yet
    assert code == 2, out
    assert f"run folder {workdir / 'run'} belongs to job 123 (sbatch, PENDING)" in out and "llmctl cancel 123" in out
    assert fake_sbatch.read_text().count("x") == 1
    (workdir / "squeue-state").write_text("")  # gone from the queue; sacct knows nothing: the folder says
    code, out = _submit(workdir)
    assert code == 0, out
    assert fake_sbatch.read_text().count("x") == 2


def test_probe_takes_nothing_and_creates_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "never-run"
    runlock.probe([folder])
    assert not folder.exists()
    lock = runlock.acquire([folder])
    try:
        with pytest.raises(runlock.RunFolderBusy, match="is in use by"):
            runlock.probe([folder])
    finally:
        lock.release()
    runlock.probe([folder])  # free again
    again = runlock.acquire([folder])  # the probe left no lock behind
    again.release()
