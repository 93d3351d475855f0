"""`llmctl status`, `logs` and `cancel` from any folder, through the per-user job index ($LLMCTL_HOME, which
tests/conftest.py points at a fresh folder for every test); what `logs` shows (the console, not the metrics); the
states a job can end in (COMPLETED, FAILED (exit N), CANCELLED, REQUEUED); and a local run cancelled cleanly: no
torchrun traceback, exit code 143, a checkpoint, CANCELLED. Stub sbatch/squeue/scancel on PATH stand in for SLURM; a
stub torchrun with one fake rank checks the cancel protocol in seconds; real torchrun runs check it end to end."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from launch_helpers import minimal_plan_yaml, write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import jobs, local, registry
from llmctl.launch.backends import backend_for


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def listed_jobs(out: str) -> list[str]:
    """The job ids in `status`'s table (its first column): a substring test would find "101" in a 10:16:40 timestamp."""
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    return [row[0] for row in rows]


def llmctl(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real CLI in its own process (as a user types it)."""
    return subprocess.run(
        [sys.executable, "-m", "llmctl", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launch ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project folder (the launch's cwd) and, beside it, a folder elsewhere to run status/logs/cancel from."""
    proj = tmp_path / "project"
    (proj / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "elsewhere" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(proj)
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    return proj


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch hands out ids 101, 102, ...; squeue prints fakebin/state-<id> when it exists (else fails, as do sacct
    and scontrol: the folder's events decide); scancel records its arguments."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    counter = bindir / "counter"
    write_stub(
        bindir,
        "sbatch",
        f'n=$(cat {str(counter)!r} 2>/dev/null || echo 100); n=$((n+1)); echo $n > {str(counter)!r}; echo "$n;cluster"',
    )
    write_stub(bindir, "squeue", f'f={str(bindir)!r}/state-"$3"; [ -f "$f" ] || exit 1; cat "$f"')
    write_stub(bindir, "scancel", f'echo "$@" >> {str(bindir / "scancelled")!r}')
    for name in ("sacct", "scontrol"):
        write_stub(bindir, name, "exit 1")
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return bindir


def launch_slurm(folder: Path) -> tuple[str, Path]:
    plan = folder / "plan.yaml"
    plan.write_text(minimal_plan_yaml(nodes=2))
    code, out, err = invoke("launch", str(plan), "--slurm")
    assert code == 0, out + err
    job_id = out.split("submitted job ")[1].split()[0]
    return job_id, Path(jobs.find(job_id).folder)


# --- where llmctl keeps its state -------------------------------------------------------------------------------


def test_home_is_llmctl_home_else_xdg_state_else_dot_local_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/h")
    monkeypatch.setenv("LLMCTL_HOME", "/a/llmctl-home")
    monkeypatch.setenv("XDG_STATE_HOME", "/x")
    assert registry.home() == Path("/a/llmctl-home")
    monkeypatch.delenv("LLMCTL_HOME")
    assert registry.home() == Path("/x/llmctl")
    monkeypatch.delenv("XDG_STATE_HOME")
    assert registry.home() == Path("/h/.local/state/llmctl")


def test_tests_never_touch_the_real_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tests/conftest.py gives every test (and what it starts) a $LLMCTL_HOME under pytest's temporary folder."""
    assert Path(os.environ["LLMCTL_HOME"]).is_relative_to(tmp_path_factory.getbasetemp())
    assert registry.home() == Path(os.environ["LLMCTL_HOME"])


def test_two_processes_registering_at_once_lose_nothing(tmp_path: Path) -> None:
    """Two launches at once: each writes its own entry file whole (no shared index to read, modify and rewrite)."""
    go = tmp_path / "go"
    code = textwrap.dedent(
        """
        import os, sys, time
        from llmctl.launch import registry
        who, go = sys.argv[1], sys.argv[2]
        while not os.path.exists(go):
            time.sleep(0.001)
        for i in range(150):
            registry.register(registry.Entry(f"{who}-{i}", "local", f"/jobs/{who}/{i:03d}", "p", f"2026-01-01T00:00:{i % 60:02d}Z"))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, who, str(go)]) for who in ("a", "b")]
    try:
        time.sleep(1.0)  # both interpreters started and waiting
        go.touch()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ids = [e.job_id for e in registry.entries()]
    assert sorted(ids) == sorted(f"{w}-{i}" for w in "ab" for i in range(150))
    assert not [p for p in registry.index_dir().iterdir() if not p.name.endswith(".json")]  # no temporary left


def test_the_index_keeps_one_entry_per_folder_path_in_launch_order() -> None:
    """Each entry as registered and read back: two job folders of one name in two roots are two jobs, listed by
    submission time (not by path); registering a folder again replaces its entry."""
    later_root = registry.Entry("1", "sbatch", "/root-b/20260101-000000-x-abcd", "x", "2026-01-01T00:00:01.000Z")
    earlier_root = registry.Entry("2", "sbatch", "/root-a/20260101-000000-x-abcd", "x", "2026-01-01T00:00:02.000Z")
    registry.register(later_root)
    registry.register(earlier_root)
    assert registry.entries() == [later_root, earlier_root]
    moved = registry.Entry("1b", "sbatch", later_root.folder, "x", "2026-01-01T00:00:03.000Z")
    registry.register(moved)
    assert registry.entries() == [earlier_root, moved]


def test_find_takes_the_newest_job_of_a_reused_id(tmp_path: Path) -> None:
    """SLURM reuses job ids (a reset controller, another cluster): `find` by id takes the latest launched."""
    for n, when in enumerate(("2026-01-01T00:00:01.000Z", "2026-01-02T00:00:01.000Z")):
        folder = tmp_path / "jobs" / f"job{n}"
        folder.mkdir(parents=True)
        jobs.JobRecord("7", "sbatch", str(folder), "x", 1, 1, when).save()
    assert jobs.find("7").folder == str(tmp_path / "jobs" / "job1")
    assert jobs.find("7", tmp_path / "jobs").folder == str(tmp_path / "jobs" / "job1")


def test_slurm_state_asks_squeue_then_sacct_then_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    said: dict[str, str] = {"scontrol": "JobId=7 JobName=x JobState=COMPLETED Reason=None\n"}
    monkeypatch.setattr(jobs, "query", lambda argv: said.get(argv[0]))
    assert jobs.slurm_state("7") == "COMPLETED"
    said["sacct"] = "CANCELLED+\n"  # sacct marks a state it shortened (CANCELLED by UID) with a +
    assert jobs.slurm_state("7") == "CANCELLED"
    said["squeue"] = "RUNNING\n"
    assert jobs.slurm_state("7") == "RUNNING"


def test_an_unwritable_index_warns_and_the_launch_goes_on(
    project: Path, fake_slurm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path / "not-a-folder"))
    plan = project / "plan.yaml"
    plan.write_text(minimal_plan_yaml(nodes=2))
    code, out, err = invoke("launch", str(plan), "--slurm")
    assert code == 0 and "submitted job 101" in out, out + err
    assert "llmctl: warning: could not register job 101 in" in err and "--jobs-dir" in err
    code, out, _ = invoke("status", "101", "--jobs-dir", str(project / "llmctl-jobs"))
    assert code == 0 and "101" in out


# --- status / logs / cancel from any folder ------------------------------------------------------------------------


def test_status_and_logs_from_any_folder_and_the_latest_job(project: Path, fake_slurm: Path, tmp_path: Path) -> None:
    first, first_folder = launch_slurm(project)
    second, second_folder = launch_slurm(project)
    assert (first, second) == ("101", "102")
    assert len(registry.entries()) == 2 and not (project / "sub" / "llmctl-jobs").exists()
    (first_folder / f"slurm-{first}.out").write_text("first job\n")
    crash = 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom\n'
    (second_folder / f"slurm-{second}.out").write_text(crash)
    (second_folder / "events").write_text("exit 1 2026-01-01T00:00:00Z restart 0\n")

    for where in (project / "sub" / "deeper", tmp_path / "elsewhere" / "deeper"):
        os.chdir(where)
        code, out, err = invoke("logs")  # no job id: the latest launched
        assert code == 0 and out == crash, (out, err)
        assert f"job {second} (the latest launched)" in err
        code, out, _ = invoke("logs", first)
        assert code == 0 and out == "first job\n"
        code, out, _ = invoke("logs", "--follow")  # the job is over: prints and returns
        assert code == 0 and out == crash
        code, out, _ = invoke("status")
        assert code == 0 and sorted(listed_jobs(out)) == [first, second] and "FAILED (exit 1)" in out, out
        assert str(second_folder) in out

    # --jobs-dir restricts to the jobs under it.
    code, out, _ = invoke("status", "--jobs-dir", str(tmp_path / "elsewhere"))
    assert code == 0 and "no jobs in" in out and len(out.strip().splitlines()) == 1, out
    code, out, err = invoke("logs", first, "--jobs-dir", str(tmp_path / "elsewhere"))
    assert code == 2 and "no job '101'" in err and not out
    code, out, _ = invoke("logs", first, "--jobs-dir", str(project / "llmctl-jobs"))
    assert code == 0 and out == "first job\n"


def test_a_deleted_job_folder_is_skipped_with_a_note(project: Path, fake_slurm: Path) -> None:
    first, first_folder = launch_slurm(project)
    second, _ = launch_slurm(project)
    shutil.rmtree(first_folder)
    os.chdir(project / "sub")
    code, out, err = invoke("status")
    assert code == 0 and listed_jobs(out) == [second], out
    assert "skipped 1 registered job(s) whose folder is gone (latest: 101" in err
    code, out, err = invoke("logs", first)
    assert code == 2 and len((out + err).strip().splitlines()) == 1
    assert f"job '101': its folder {first_folder} no longer exists" in out + err
    code, out, _ = invoke("logs")  # the latest that still has a folder
    assert code == 0, out


def test_jobs_launched_before_the_index_are_still_listed_from_their_folder(project: Path, fake_slurm: Path) -> None:
    job_id, _ = launch_slurm(project)
    shutil.rmtree(registry.index_dir())  # as if an older llmctl had launched it
    code, out, _ = invoke("status")
    assert code == 0 and job_id in out
    os.chdir(project / "sub")
    code, out, _ = invoke("status")
    assert code == 0 and "no jobs in" in out


def test_logs_without_any_job_is_one_line(project: Path) -> None:
    code, out, err = invoke("logs")
    assert code == 2 and len((out + err).strip().splitlines()) == 1 and "no jobs in the job index" in out + err


# --- states --------------------------------------------------------------------------------------------------------


def _record(folder: Path, events: str) -> jobs.JobRecord:
    (folder / "events").write_text(events)
    return jobs.JobRecord("1", "sbatch", str(folder), "p", 1, 1, "2026-01-01T00:00:00Z")


@pytest.mark.parametrize(
    "events, state",
    [
        ("", "UNKNOWN"),
        ("exit 0 T restart 0\n", "COMPLETED"),
        ("exit 3 T restart 0\n", "FAILED (exit 3)"),
        ("preflight ok T restart 0: training on a,b\n", "UNKNOWN"),
        ("requeued T restart 0\n", "REQUEUED"),
        ("requeued T restart 0\nexit 0 T restart 1\n", "COMPLETED"),
        # scancel: the batch script still appends its exit line after the cancel was recorded.
        ("cancelled T by llmctl cancel\nexit 143 T restart 0\n", "CANCELLED"),
        ("cancel-requested T\n", "CANCELLING"),
        ("cancel-requested T\ncancelled T step 5 checkpoint 5 exit 0\n", "CANCELLED"),
        ("cancel-requested T\nexit 0 T restart 0\n", "COMPLETED"),  # it finished before the stop took effect
    ],
)
def test_folder_state(tmp_path: Path, events: str, state: str) -> None:
    assert jobs.folder_state(_record(tmp_path, events)) == state


@pytest.mark.parametrize(
    "slurm, folder, requeued, state",
    [
        (None, "REQUEUED", 1, "REQUEUED"),
        (None, "FAILED (exit 1)", 0, "FAILED (exit 1)"),
        ("PENDING", "UNKNOWN", 0, "PENDING"),
        ("PENDING", "REQUEUED", 1, "REQUEUED (pending, restart 1)"),
        ("RUNNING", "REQUEUED", 2, "RUNNING (restart 2)"),
        ("RUNNING", "CANCELLED", 0, "CANCELLING"),
        ("CANCELLED", "FAILED (exit 143)", 0, "CANCELLED"),
        ("COMPLETED", "CANCELLED", 0, "CANCELLED"),
        ("FAILED", "FAILED (exit 3)", 0, "FAILED (exit 3)"),
        ("PREEMPTED", "UNKNOWN", 0, "PREEMPTED"),
        ("COMPLETED", "COMPLETED", 1, "COMPLETED"),
    ],
)
def test_slurm_job_state(slurm: str | None, folder: str, requeued: int, state: str) -> None:
    assert jobs.slurm_job_state(slurm, folder, requeued) == state


def test_slurm_requeued_then_cancelled_through_the_cli(project: Path, fake_slurm: Path) -> None:
    job_id, folder = launch_slurm(project)
    (folder / "events").write_text("requeued 2026-01-01T00:00:00Z restart 0\n")
    (fake_slurm / f"state-{job_id}").write_text("PENDING\n")
    code, out, _ = invoke("status", job_id)
    assert code == 0 and "REQUEUED (pending, restart 1)" in out, out
    code, out, _ = invoke("cancel", job_id)
    assert code == 0 and out == f"cancelled job {job_id} (sbatch)\n"
    assert (fake_slurm / "scancelled").read_text() == f"{job_id}\n"
    (fake_slurm / f"state-{job_id}").unlink()  # SLURM forgot it (no accounting): the folder remembers
    (folder / "events").open("a").write("exit 143 2026-01-01T00:01:00Z restart 1\n")
    code, out, _ = invoke("status", job_id)
    assert code == 0 and "CANCELLED" in out and "FAILED" not in out, out


# --- a local run cancelled: the protocol, with a stub torchrun and one fake rank -----------------------------------

FAKE_RANK = """
import json, os, signal, sys, time
print("fake rank starting", flush=True)
time.sleep(3)  # importing torch: a SIGTERM now would kill it (cancel must wait for the handler)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
parent, step = os.getppid(), 0
os.makedirs("run", exist_ok=True)
while not stop and step < 1000 and os.getppid() == parent:
    step += 1
    print(f"step {step}/1000", flush=True)
    with open("run/metrics.jsonl", "a") as f:
        f.write(json.dumps({"event": "step", "step": step}) + "\\n")
    time.sleep(0.1)
os.makedirs(f"ckpt/step_{step:08d}")
with open("run/metrics.jsonl", "a") as f:
    for rec in ({"event": "checkpoint", "step": step}, {"event": "stop", "step": step}, {"event": "end", "reason": "signal"}):
        f.write(json.dumps(rec) + "\\n")
print(f"[stop] stopping at step {step}", flush=True)
"""

FAKE_TORCHRUN = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, sys.argv[0] + "-rank.py", "llmctl.engine", *sys.argv[1:]])
code = rank.wait()
sys.exit(code if code >= 0 else 128 - code)
"""


def plan_with_checkpoints(folder: Path, nproc: int = 1, max_steps: int = 3) -> Path:
    """A tiny plan (synthetic data) that checkpoints into ckpt/ only when stopped, and logs every step into run/."""
    plan = folder / "plan.yaml"
    plan.write_text(
        f"version: 1\nname: cancel-me\nmodel:\n  preset: llama-tiny\ndata:\n  kind: synthetic\n"
        f"hardware:\n  nodes: 1\n  nproc_per_node: {nproc}\n"
        f"training:\n  max_steps: {max_steps}\n  precision: fp32\n  seq_len: 32\n  micro_batch_size: 2\n"
        "checkpoint:\n  dir: ckpt\n  interval_steps: 100000\nlogging:\n  dir: run\n  interval_steps: 1\n"
    )
    return plan


@pytest.fixture
def launched() -> Iterator[list[subprocess.Popen]]:
    """Launching processes a test started (each in its own session): killed, with what they started, at the end."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        else:
            with contextlib.suppress(ProcessLookupError):  # what it started may outlive it (an orphaned rank)
                os.killpg(p.pid, signal.SIGKILL)


def start_launch(cwd: Path, out: Path, err: Path, argv_prefix: list[str], env: dict[str, str] | None = None):
    return subprocess.Popen(
        [*argv_prefix, "launch", "plan.yaml", "--allow-synthetic"],
        cwd=cwd,
        stdout=out.open("w"),
        stderr=err.open("w"),
        env={**os.environ, "TMPDIR": str(cwd), **(env or {})},
        start_new_session=True,  # the test can end it and everything it started
    )


def test_cancel_a_local_run_with_a_fake_rank(project: Path, tmp_path: Path, launched: list) -> None:
    """cancel waits for the rank to catch SIGTERM, signals the rank (not torchrun), and waits for the end; the
    launching llmctl prints one line and exits 143; status says CANCELLED with the checkpoint; logs shows the console."""
    plan_with_checkpoints(project)
    stub = tmp_path / "torchrun"
    stub.write_text(f"#!{sys.executable}\n{FAKE_TORCHRUN}")
    stub.chmod(0o755)
    Path(f"{stub}-rank.py").write_text(FAKE_RANK)
    code = (
        "import sys; from llmctl.launch import local; stub = sys.argv[1]; local.torchrun_command = lambda: [stub];"
        "from llmctl.cli.main import main; sys.argv = ['llmctl', *sys.argv[2:]]; main()"
    )
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    proc = start_launch(project, out, err, [sys.executable, "-c", code, str(stub)])
    launched.append(proc)
    wait_for("the job record", lambda: bool(registry.entries()) and registry.entries()[0].job_id != "local", 60, proc)
    job_id = registry.entries()[0].job_id
    elsewhere = tmp_path / "elsewhere" / "deeper"
    assert "RUNNING" in llmctl("status", job_id, cwd=elsewhere).stdout

    follow = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "logs", "--follow"],
        cwd=elsewhere,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as the `launched` fixture expects
    )
    launched.append(follow)
    cancel = llmctl("cancel", job_id, cwd=elsewhere)  # right away: the rank is still "importing torch"
    assert cancel.returncode == 0, cancel.stderr
    assert proc.wait(timeout=60) == local.CANCELLED_EXIT == 143
    message = cancel.stdout.strip()
    assert message.startswith(f"job {job_id} cancelled at step ") and len(cancel.stdout.splitlines()) == 1
    step = int(message.split(" at step ")[1].split(":")[0])
    assert message == (
        f"job {job_id} cancelled at step {step}: checkpoint at step {step} saved (launch the plan again to resume"
        " from it)"
    )
    stderr = err.read_text()
    assert stderr.strip().splitlines()[-1] == f"llmctl: {message}" and "Traceback" not in stderr
    assert (project / "ckpt" / f"step_{step:08d}").is_dir()
    assert "fake rank starting" in out.read_text()  # the terminal still got the rank's output

    status = llmctl("status", cwd=elsewhere).stdout
    assert job_id in status and "CANCELLED" in status and f"step {step}" in status, status
    record = jobs.find(job_id)
    events = jobs.events(record)
    assert events[0].startswith("cancel-requested ") and events[-1].startswith("cancelled ") and len(events) == 2
    logs = llmctl("logs", cwd=elsewhere)
    assert (
        logs.returncode == 0
        and "fake rank starting\n" in logs.stdout
        and f"[stop] stopping at step {step}" in logs.stdout
    )
    assert '"event"' not in logs.stdout  # the console, not metrics.jsonl
    assert logs.stdout == (Path(record.folder) / "console.log").read_text()
    followed, _ = follow.communicate(timeout=30)  # --follow ends by itself once the job has
    assert follow.returncode == 0 and followed == logs.stdout
    again = llmctl("cancel", job_id, cwd=elsewhere)
    assert again.returncode == 2 and "is not running (state CANCELLED)" in again.stderr, again


# --- real torchrun runs ---------------------------------------------------------------------------------------------

CRASH_RANK_1 = """
import os, sys
if os.environ.get("RANK") == "1":
    import importlib.abc, importlib.util

    class _Crash(importlib.abc.MetaPathFinder):
        # rank 1's engine loop raises a bug (not an LlmctlError): its traceback goes to its stderr.
        def find_spec(self, name, path=None, target=None):
            if name != "llmctl.engine.loop":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)

                def run(plan):
                    raise ZeroDivisionError("injected crash on rank 1")

                module.run = run

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Crash())
"""


@pytest.mark.dist
def test_cancel_a_real_local_run_cleanly(project: Path, tmp_path: Path, launched: list) -> None:
    """torchrun with 2 engine ranks on gloo, cancelled mid-run from another folder: the ranks checkpoint, torchrun
    ends without its SignalException traceback, the launching llmctl exits 143 with one line, status says
    CANCELLED with the checkpoint's step, and `logs` (no id) shows what the console showed."""
    plan_with_checkpoints(project, nproc=2, max_steps=100000)
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    proc = start_launch(project, out, err, [sys.executable, "-m", "llmctl"])
    launched.append(proc)
    metrics = project / "run" / "metrics.jsonl"
    wait_for("the first step", lambda: metrics.is_file() and '"event": "step"' in metrics.read_text(), 240, proc)
    job_id = registry.entries()[-1].job_id
    elsewhere = tmp_path / "elsewhere" / "deeper"
    cancel = llmctl("cancel", job_id, cwd=elsewhere, timeout=240)
    assert cancel.returncode == 0, cancel.stderr
    assert proc.wait(timeout=120) == 143
    stderr = err.read_text()
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    message = cancel.stdout.strip()
    step = int(message.split(" at step ")[1].split(":")[0])
    assert message.startswith(f"job {job_id} cancelled at step {step}: checkpoint at step {step} saved"), message
    assert stderr.strip().splitlines()[-1] == f"llmctl: {message}"
    assert (project / "ckpt" / f"step_{step:08d}").is_dir()
    status = llmctl("status", job_id, cwd=elsewhere)
    assert "CANCELLED" in status.stdout and f"step {step}" in status.stdout, status
    logs = llmctl("logs", cwd=project / "sub")
    assert logs.returncode == 0 and "step 1/100000" in logs.stdout and f"[stop] stopping at step {step}" in logs.stdout
    assert '"event"' not in logs.stdout


@pytest.mark.dist
def test_a_crashed_rank_traceback_is_kept_and_shown_by_logs(project: Path, tmp_path: Path, launched: list) -> None:
    """A rank that raises (a bug: it keeps its traceback): the launching llmctl says where the output is, one line,
    exit 1; the job folder's console.log holds the traceback; `llmctl logs` from elsewhere prints it; FAILED (exit 1)."""
    plan_with_checkpoints(project, nproc=2)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_RANK_1)
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    env = {"PYTHONPATH": str(hook), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"}  # rank 0 waits in its rendezvous
    proc = start_launch(project, out, err, [sys.executable, "-m", "llmctl"], env)
    launched.append(proc)
    assert proc.wait(timeout=240) == 1, err.read_text()[-3000:]
    job_id = registry.entries()[-1].job_id
    record = jobs.find(job_id)
    console = (Path(record.folder) / "console.log").read_text()
    assert "Traceback (most recent call last)" in console and "ZeroDivisionError: injected crash on rank 1" in console
    last = err.read_text().strip().splitlines()[-1]
    assert last == (
        f"llmctl: error: the run exited with code 1 (its output: {record.folder}/console.log, or"
        f" `llmctl logs {job_id}`)"
    )
    logs = llmctl("logs", cwd=tmp_path / "elsewhere")
    assert logs.returncode == 0 and logs.stdout == console
    assert "FAILED (exit 1)" in llmctl("status", job_id, cwd=tmp_path / "elsewhere").stdout


def test_submitit_logs_show_task_0_then_every_other_tasks_stderr(tmp_path: Path) -> None:
    """A rank that crashed alone left its traceback in its own task's stderr: `logs` shows it after task 0's console,
    under a header naming the file, tasks in numeric order."""
    folder = tmp_path / "jobs" / "20260101-000000-x-abcd"
    sub = folder / "submitit"
    sub.mkdir(parents=True)
    (sub / "101_0_log.out").write_text("task 0 out\n")
    (sub / "101_0_log.err").write_text("")
    (sub / "101_1_log.err").write_text("Traceback (most recent call last):\nValueError: rank 1\n")
    (sub / "101_10_log.err").write_text("ten\n")
    (sub / "101_2_log.out").write_text("task 2 stdout: not shown\n")
    (sub / "102_3_log.err").write_text("another job's task\n")
    logs = [str(sub / "101_0_log.out"), str(sub / "101_0_log.err")]
    record = jobs.JobRecord("101", "submitit", str(folder), "x", 2, 6, "2026-01-01T00:00:00.000Z", logs=logs)
    record.save()
    # The files themselves, before the rendering: task 0's two once, then the other tasks' stderr in task order.
    assert backend_for(record).logs(record) == [
        sub / "101_0_log.out",
        sub / "101_0_log.err",
        sub / "101_1_log.err",
        sub / "101_10_log.err",
    ]
    code, out, _ = invoke("logs", "101")
    assert code == 0
    assert out == (
        f"task 0 out\n\n==> {sub / '101_1_log.err'} <==\nTraceback (most recent call last):\nValueError: rank 1\n"
        f"\n==> {sub / '101_10_log.err'} <==\nten\n"
    )
