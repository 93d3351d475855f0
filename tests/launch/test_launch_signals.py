"""SIGTERM, SIGHUP and SIGINT to a local `llmctl launch` (a job wrapper or CI timeout, a closed terminal, Ctrl-C) do
what `llmctl cancel` does (issue 46): the ranks checkpoint and stop, no process of the run is left, the job is
CANCELLED, and llmctl exits with 128 + the signal's number and one line. Before, llmctl died at once and its ranks
went on training with parent pid 1, then died on the closed pipe before their checkpoint; `status` said UNKNOWN.

A stub torchrun with one fake rank checks the protocol for each signal in seconds; one real torchrun run of the
engine (2 ranks on gloo) checks it end to end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_jobs_registry import (
    FAKE_RANK,
    FAKE_TORCHRUN,
    launched,
    llmctl,
    plan_with_checkpoints,
    project,
    start_launch,
    wait_for,
)

from llmctl.launch import jobs, registry

__all__ = ["launched", "project"]  # fixtures, imported for the tests below


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (children, theirs, ...): pid -> its start time (/proc/PID/stat field 22), which
    tells it from a later process that reused the pid."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(p.name))
        starts[int(p.name)] = fields[19]
    out, todo = {}, list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        out[child] = starts[child]
        todo += parents.get(child, [])
    for seen in _SEEN:  # killed at the test's end if still running (_no_leftovers)
        seen.append(out)
    return out


def still_running(procs: dict[int, str]) -> list[int]:
    """Those of `procs` still running (a zombie has ended: one whose parent is gone waits for pid 1 to reap it)."""
    alive = []
    for pid, start in procs.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            alive.append(pid)
    return alive


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[list[dict[int, str]]]:
    """Every run a test looked at (`descendants`): what is still running at the end is killed (torchrun runs in a
    session of its own, out of reach of `launched`'s killpg), after the test has said whether anything was left."""
    seen: list[dict[int, str]] = []
    _SEEN.append(seen)
    yield seen
    _SEEN.remove(seen)
    for procs in seen:
        for pid in still_running(procs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


_SEEN: list[list[dict[int, str]]] = []


def fake_launch(project: Path, tmp_path: Path, launched: list, rank: str = FAKE_RANK) -> tuple[subprocess.Popen, Path]:
    """`llmctl launch` of a plan whose torchrun is a stub with one fake rank that checkpoints when asked to stop."""
    plan_with_checkpoints(project)
    stub = tmp_path / "torchrun"
    stub.write_text(f"#!{sys.executable}\n{FAKE_TORCHRUN}")
    stub.chmod(0o755)
    Path(f"{stub}-rank.py").write_text(rank)
    code = (
        "import sys; from llmctl.launch import local; stub = sys.argv[1]; local.torchrun_command = lambda: [stub];"
        "from llmctl.cli.main import main; sys.argv = ['llmctl', *sys.argv[2:]]; main()"
    )
    err = tmp_path / "launch.err"
    proc = start_launch(project, tmp_path / "launch.out", err, [sys.executable, "-c", code, str(stub)])
    launched.append(proc)
    return proc, err


def check_cancelled(project: Path, proc: subprocess.Popen, err: Path, sig: signal.Signals, run: dict[int, str]) -> int:
    """After `sig` to the launching llmctl: its exit code, its one last line, the checkpoint, CANCELLED, nothing left.
    Returns the step it stopped at."""
    assert proc.wait(timeout=240) == 128 + sig
    job_id = registry.entries()[-1].job_id
    lines = err.read_text().strip().splitlines()
    assert "Traceback" not in err.read_text(), lines[-30:]
    step = int(lines[-1].split(" at step ")[1].split(":")[0])
    assert lines[-1] == (
        f"llmctl: job {job_id} cancelled by {sig.name} at step {step}: checkpoint at step {step} saved (launch the plan"
        " again to resume from it)"
    ), lines[-5:]
    assert (project / "ckpt" / f"step_{step:08d}").is_dir()
    wait_for("the run's processes to end", lambda: not still_running(run), 10)  # already gone: llmctl waited
    status = llmctl("status", job_id, cwd=project)
    assert "CANCELLED" in status.stdout and f"step {step}" in status.stdout, status.stdout
    events = jobs.events(jobs.find(job_id))
    assert events[0].startswith("cancel-requested ") and events[0].endswith(f" by {sig.name}"), events
    assert events[-1].startswith("cancelled ") and events[-1].endswith(f" by {sig.name}") and len(events) == 2
    return step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_launch_cancels_the_run(project: Path, tmp_path: Path, launched: list, sig: signal.Signals):
    proc, err = fake_launch(project, tmp_path, launched)
    metrics = project / "run" / "metrics.jsonl"
    wait_for("the first step", lambda: metrics.is_file() and '"step"' in metrics.read_text(), 60, proc)
    run = descendants(proc.pid)
    assert len(run) >= 2, run  # torchrun and its rank
    proc.send_signal(sig)  # to llmctl alone, as `kill PID` or a job wrapper sends it
    check_cancelled(project, proc, err, sig, run)


def test_a_signal_while_the_ranks_start_waits_for_them(project: Path, tmp_path: Path, launched: list) -> None:
    """The rank is still "importing torch" (no handler yet): llmctl waits until it listens, as cancel does."""
    proc, err = fake_launch(project, tmp_path, launched)
    wait_for("the rank", lambda: "fake rank starting" in (tmp_path / "launch.out").read_text(), 60, proc)
    run = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    check_cancelled(project, proc, err, signal.SIGTERM, run)


def test_a_second_signal_ends_the_run_at_once(project: Path, tmp_path: Path, launched: list) -> None:
    """The rank ignores the stop (stuck): the second SIGTERM goes to torchrun, which ends it; nothing is left."""
    plan_with_checkpoints(project)
    stub = tmp_path / "torchrun"
    stub.write_text(f"#!{sys.executable}\n{FAKE_TORCHRUN}")
    stub.chmod(0o755)
    stuck = FAKE_RANK.replace("lambda *a: stop.append(1)", "lambda *a: None")
    Path(f"{stub}-rank.py").write_text(stuck)
    code = (
        "import sys; from llmctl.launch import local; stub = sys.argv[1]; local.torchrun_command = lambda: [stub];"
        "from llmctl.cli.main import main; sys.argv = ['llmctl', *sys.argv[2:]]; main()"
    )
    err = tmp_path / "launch.err"
    proc = start_launch(project, tmp_path / "launch.out", err, [sys.executable, "-c", code, str(stub)])
    launched.append(proc)
    metrics = project / "run" / "metrics.jsonl"
    wait_for("the first step", lambda: metrics.is_file() and '"step"' in metrics.read_text(), 60, proc)
    run = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    wait_for("the stop request", lambda: "cancel-requested" in _events(), 30, proc)
    proc.send_signal(signal.SIGTERM)  # the fake torchrun dies of it; its rank sees its parent go and ends
    assert proc.wait(timeout=60) == 143
    assert err.read_text().strip().splitlines()[-1].startswith("llmctl: job local-")
    wait_for("the run's processes to end", lambda: not still_running(run), 10)


def _events() -> str:
    entries = registry.entries()
    return "\n".join(jobs.events(jobs.find(entries[-1].job_id))) if entries else ""


@pytest.mark.dist
def test_sigterm_to_a_real_launch_checkpoints_and_leaves_nothing(project: Path, tmp_path: Path, launched: list) -> None:
    """torchrun with 2 engine ranks on gloo; SIGTERM to the launching llmctl mid-run: the ranks save a checkpoint of
    the step they stopped at, no process of the run is left, status says CANCELLED, exit 143 with one line."""
    plan_with_checkpoints(project, nproc=2, max_steps=100000)
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    proc = start_launch(project, out, err, [sys.executable, "-m", "llmctl"])
    launched.append(proc)
    metrics = project / "run" / "metrics.jsonl"
    wait_for("the first step", lambda: metrics.is_file() and '"event": "step"' in metrics.read_text(), 240, proc)
    run = descendants(proc.pid)
    assert len(run) >= 3, run  # torchrun and 2 ranks
    proc.send_signal(signal.SIGTERM)
    step = check_cancelled(project, proc, err, signal.SIGTERM, run)
    assert f"[stop] stopping at step {step}" in out.read_text() + err.read_text()


def test_sigkill_to_launch_still_ends_the_run(project: Path, tmp_path: Path, launched: list) -> None:
    """SIGKILL cannot be handled; torchrun, in a session of its own, gets SIGTERM when llmctl dies (its parent-death
    signal), so a run that prints nothing does not train on unwatched. The fake rank ends when torchrun does."""
    silent = FAKE_RANK.replace('print(f"step {step}/1000", flush=True)', "pass")
    assert silent != FAKE_RANK
    proc, _ = fake_launch(project, tmp_path, launched, silent)
    metrics = project / "run" / "metrics.jsonl"  # its steps: past its start, it watches its parent
    wait_for("the first step", lambda: metrics.is_file() and '"step"' in metrics.read_text(), 60, proc)
    run = descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    wait_for("the run's processes to end", lambda: not still_running(run), 20)
