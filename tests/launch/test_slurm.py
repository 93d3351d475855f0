"""Real SLURM (single host, 2 fake nodes, started by the `slurm_cluster` fixture): 2-node engine jobs through
sbatch and submitit, and preemption: signal -> checkpoint -> requeue -> resume, with every step done exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from launch_helpers import REPO, TINY_PLAN
from typer.testing import CliRunner

from llmctl.cli.main import app

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

SECRETS = {"HF_TOKEN": "hf_slurm_s3cr3t", "WANDB_API_KEY": "wandb_slurm_s3cr3t"}


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def squeue_state(job_id: str) -> str:
    """The job's state, "" once it has left the queue, "?" when squeue itself failed (try again)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        return "?"
    return out.stdout.strip()


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True)


def nodes_idle() -> bool:
    """Every node of the test cluster is idle: nothing of a previous job instance is still being cleaned up."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True)
    states = out.stdout.split()
    return out.returncode == 0 and bool(states) and all(s == "idle" for s in states)


_PENDING_SINCE: dict[str, float] = {}


def release_if_ready(job_id: str) -> None:
    """Start a requeued job now instead of at its BeginTime, but not within 3 s of its requeue. slurmd refuses to
    launch a job whose credential was created no later than the second in which the job's previous instance was
    killed (slurm_cred_revoked compares whole seconds: "Job N already killed, do not launch batch job"); SLURM's
    BeginTime delay after a requeue is what normally avoids that. Forcing StartTime=now 50 ms after the requeue
    let the new instance start in the same second and fail at once (exit 1 in 3 ms): the CI failure."""
    if squeue_state(job_id) != "PENDING":
        return
    since = _PENDING_SINCE.setdefault(job_id, time.monotonic())
    if time.monotonic() - since >= 3 and nodes_idle():
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)


def start_now(job_id: str, timeout_s: float = 150) -> None:
    """Release the requeued job (see `release_if_ready`), repeated until it runs: an update made while the
    requeue is still completing is overwritten when it completes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = squeue_state(job_id)
        if state not in ("PENDING", "?"):
            return
        release_if_ready(job_id)
        time.sleep(2)
    raise AssertionError(f"job {job_id} still pending after {timeout_s:.0f} s")


def events(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl, read while the engine may be appending to it: a partial last line is not an event yet."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().split("\n"):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # only the last line can be partial: complete lines end with a newline
    return out


def job_events(folder: Path) -> list[str]:
    """The lines the batch script appended to the job folder's events file, without the preflight's."""
    path = folder / "events"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [ln for ln in lines if not ln.startswith("preflight ")]


def steps_logged(run_dir: Path) -> list[int]:
    return [e["step"] for e in events(run_dir) if e["event"] == "step"]


@pytest.fixture
def job_env(slurm_cluster: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if not (REPO / "llmctl" / "engine" / "__main__.py").is_file() or not TINY_PLAN.is_file():
        pytest.skip("the engine or examples/tiny-cpu.yaml is not there yet")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # torchrun leaves torchelastic_* folders there
    monkeypatch.delenv("LLMCTL_JOBS_DIR", raising=False)
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def make_plan(folder: Path, max_steps: int, log_every: int = 1, ckpt_every: int = 1000) -> Path:
    plan = yaml.safe_load(TINY_PLAN.read_text())
    plan["training"]["max_steps"] = max_steps
    plan["data"]["paths"] = [str(TINY_PLAN.parent / p) for p in plan["data"]["paths"]]  # relative to the plan
    plan["checkpoint"].update(dir=str(folder / "run" / "checkpoints"), interval_steps=ckpt_every)
    plan["logging"] = {"dir": str(folder / "run"), "interval_steps": log_every}
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


LAUNCHED: list[str] = []
"""Job ids submitted by this module (a failed attempt's job is cancelled before the retry)."""


def launch(*args: str) -> tuple[str, Path]:
    result = CliRunner().invoke(app, ["launch", *args])
    assert result.exit_code == 0, result.output
    job_id = result.output.split("submitted job ")[1].split()[0]
    LAUNCHED.append(job_id)
    folder = Path(result.output.split("job folder: ")[1].splitlines()[0].strip("'"))
    return job_id, folder


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def assert_no_secrets(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file() and not f.name.endswith(".pkl"):
            text = f.read_bytes().decode(errors="replace")
            assert not any(v in text for v in SECRETS.values()), f"a secret was written into {f}"
        elif f.is_file():
            assert not any(v.encode() in f.read_bytes() for v in SECRETS.values()), f"secret in {f}"


def interrupt_and_resume(job_id: str, run_dir: Path, signal_cmd: list[str], at_step: int) -> None:
    """Once the engine has logged `at_step`, signal; wait for the requeue; start the requeued job now (SLURM
    would otherwise hold it ~2 min as BeginTime)."""
    wait_for(f"step {at_step}", lambda: len(steps_logged(run_dir)) >= at_step, 180)
    subprocess.run(signal_cmd, check=True)
    wait_for(
        "the requeue",
        lambda: (
            squeue_state(job_id) == "PENDING" or any(e["event"] == "start" and e["step"] > 0 for e in events(run_dir))
        ),
        120,
    )
    start_now(job_id)


def diagnosis(job_id: str, run_dir: Path, folder: Path) -> str:
    """What SLURM, the job folder and the engine say about a job: printed when a wait times out, so that a CI
    failure can be understood from its log alone."""

    def run(*argv: str) -> str:
        out = subprocess.run(list(argv), capture_output=True, text=True)
        return (out.stdout + out.stderr).strip()

    logs = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".out", ".err"))
    logs += sorted((Path(os.environ.get("LLMCTL_SLURM_DIR", "/nonexistent")) / "log").glob("slurm*.log"))
    parts = [
        f"squeue: {squeue_state(job_id)!r}",
        "scontrol: " + run("scontrol", "show", "job", job_id)[:1500],
        "sacct: " + run("sacct", "-j", job_id, "-o", "JobID,State,ExitCode,Restarts,NodeList", "-P")[:1500],
        "job events: " + ((folder / "events").read_text() if (folder / "events").is_file() else "(none)"),
        "engine events: " + "\n".join(json.dumps(e) for e in events(run_dir) if e["event"] != "step"),
        f"steps logged: {steps_logged(run_dir)}",
    ]
    for p in logs:
        text = p.read_text(errors="replace")
        if p.name.startswith("slurm") and p.suffix == ".log":  # the daemons' lines about this job only
            mine = (f"JobId={job_id} ", f"StepId={job_id}.", f"job {job_id} ", f"job{job_id} ", "error")
            text = "\n".join(ln for ln in text.splitlines() if any(m in ln + " " for m in mine))
        parts.append(f"--- {p} (tail)\n{text[-4000:]}")
    return "\n".join(parts)


def wait_for_resumed_run(job_id: str, run_dir: Path, folder: Path, timeout_s: float = 300) -> None:
    """The requeued run has finished: its `end ... done` event is logged and the job has left the queue. squeue
    alone is not evidence (around a requeue it can briefly report nothing); a job still pending is released now."""

    def finished() -> bool:
        state = squeue_state(job_id)
        if state == "PENDING":
            release_if_ready(job_id)
        done = any(e["event"] == "end" and e.get("reason") == "done" for e in events(run_dir))
        return done and state == ""

    try:
        wait_for("the requeued run to finish", finished, timeout_s, every_s=1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnosis(job_id, run_dir, folder)}") from None


def assert_resumed_exactly_once(run_dir: Path, total: int) -> int:
    """One signal stop at step k with a checkpoint at k; the second start resumes at k; steps 1..total logged
    once each (none lost, none redone past the checkpoint); the run ends done at total. Returns k."""
    ev = events(run_dir)
    stops = [e for e in ev if e["event"] == "stop"]
    assert len(stops) == 1 and stops[0]["reason"] == "signal", ev
    k = stops[0]["step"]
    assert 0 < k < total
    assert any(e["event"] == "checkpoint" and e["step"] == k for e in ev)
    starts = [e["step"] for e in ev if e["event"] == "start"]
    assert starts == [0, k], starts
    assert steps_logged(run_dir) == list(range(1, total + 1))
    assert ev[-1]["event"] == "end" and ev[-1]["reason"] == "done" and ev[-1]["step"] == total
    return k


def test_sbatch_two_node_job_finishes_with_metrics(job_env: Path) -> None:
    plan = make_plan(job_env, max_steps=10, log_every=5)
    before = plan.read_bytes()
    job_id, folder = launch(
        str(plan), "--slurm", "--nodes", "2", "--nproc-per-node", "1", "--time", "10", "--signal-lead", "60"
    )
    wait_for("the job to end", lambda: squeue_state(job_id) == "", 240)
    ev = events(job_env / "run")
    start = next(e for e in ev if e["event"] == "start")
    assert start["world_size"] == 2 and start["backend"] == "gloo"
    assert steps_logged(job_env / "run") == [5, 10]
    assert ev[-1] == {**ev[-1], "event": "end", "reason": "done", "step": 10}
    assert "COMPLETED" in cli("status", job_id)
    log = cli("logs", job_id)
    assert "rendezvous 127.0.0.1:" in log and "finished at step 10/10" in log
    assert [ln.split()[:2] for ln in job_events(folder)] == [["exit", "0"]]
    assert plan.read_bytes() == before
    assert_no_secrets(folder)
    # The preflight ran first (on by default) and passed: both nodes checked, the quick bench across them.
    assert "llmctl: preflight: node1: ok (1 rank(s) on cpu" in log and "llmctl: preflight: node2: ok" in log
    assert "llmctl: preflight: all-reduce across 2 nodes: busbw" in log
    assert "llmctl: preflight: pair node1-node2: busbw" in log
    assert "llmctl: preflight: training on node1,node2 (took " in log
    lines = (folder / "events").read_text().splitlines()
    assert lines[0].startswith("preflight ok ") and lines[0].endswith("restart 0: training on node1,node2"), lines
    result = json.loads((folder / "preflight" / f"{job_id}.0" / "result.json").read_text())
    assert result["train"] == ["node1", "node2"] and result["dropped"] == {} and result["failure"] is None
    assert result["measured"]["inter_node_busbw_gbytes_s"] > 0
    assert "ok: training on node1,node2" in cli("status", job_id)


def planned_run(folder: Path) -> tuple[Path, int]:
    """What a user does: prepare data, then `llmctl plan --data ... --run-dir ...` (CPU-sized pins: fp32, a tiny
    batch, SDPA, no compile). Returns the plan and its number of steps on 2 nodes x 1 process."""
    docs = [d for d in (REPO / "examples" / "corpus" / "stdlib-docstrings.txt").read_text().split("\n\n") if d.strip()]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:400]))
    cli("data", "prepare", str(folder / "docs.jsonl"), "--out", str(folder / "prepared"), "--val-fraction", "0.05")
    # Pins: plan llama-tiny as if on GPUs, with what a CPU runs (fp32, SDPA, no compile) and a small batch.
    pins = ["--precision", "fp32", "--seq-len", "128", "--global-batch", "16", "--micro-batch", "8"]
    pins += ["--checkpointing", "none", "--attention", "sdpa", "--no-compile", "--loss-chunk", "0"]
    plan = folder / "plan.yaml"
    out = cli(
        "plan", "llama-tiny", "--gpu", "A100-80GB", "--nodes", "2", "--gpus-per-node", "1", "--inter-gbps", "100",
        *pins, "--tokens", "120k", "--data", str(folder / "prepared"), "--run-dir", str(folder / "run"), "-o", str(plan),
    )  # fmt: skip
    assert "data: " in out and "val split" in out, out
    written = yaml.safe_load(plan.read_text())
    assert written["data"]["kind"] == "tokens" and written["checkpoint"]["dir"] == str(folder / "run" / "checkpoints")
    # The one edit: the test cluster's fake nodes have no GPU (a plan names its GPU kind, and the job would ask SLURM
    # for --gpus-per-node, which these nodes cannot give). Everything else runs as `plan` wrote it.
    written["hardware"]["gpu"] = None
    plan.write_text(yaml.safe_dump(written, sort_keys=False))
    t = written["training"]
    steps = -(-t["token_budget"] // (t["micro_batch_size"] * t["grad_accum_steps"] * 2 * t["seq_len"]))
    return plan, steps


def sbatch_requeue(job_env: Path) -> None:
    plan, total = planned_run(job_env)
    job_id, folder = launch(str(plan), "--slurm", "--nodes", "2", "--nproc-per-node", "1", "--signal-lead", "60")
    interrupt_and_resume(job_id, job_env / "run", ["scancel", "--batch", "--signal=USR1", job_id], at_step=5)
    wait_for_resumed_run(job_id, job_env / "run", folder)
    k = assert_resumed_exactly_once(job_env / "run", total)
    lines = job_events(folder)
    assert lines[0].startswith("requeued ") and lines[-1].startswith("exit 0 ") and "restart 1" in lines[-1]
    log = (folder / f"slurm-{job_id}.out").read_text()
    assert "SIGUSR1" in log and f"resuming at step {k}/{total}" in log  # one log across both runs (open-mode append)
    assert "validation loss" in log  # the prepared folder's val split, as the plan says
    assert log.count("closing signal SIGUSR1") == 2  # each node's torchrun forwarded it (not killed by it)
    assert "COMPLETED" in cli("status", job_id)
    assert_no_secrets(folder)


def submitit_requeue(job_env: Path) -> None:
    plan = make_plan(job_env, max_steps=30)
    job_id, folder = launch(
        str(plan), "--executor", "submitit", "--nodes", "2", "--nproc-per-node", "1", "--signal-lead", "60"
    )
    sbatch_script = next((folder / "submitit").glob("*_submission.sh")).read_text()
    assert "#SBATCH --signal=USR1@60" in sbatch_script and "#SBATCH --ntasks-per-node=1" in sbatch_script
    interrupt_and_resume(
        job_id,
        job_env / "run",
        ["bash", "-c", f"scancel --signal=TERM {job_id} && scancel --signal=USR1 {job_id}"],
        at_step=5,
    )
    wait_for_resumed_run(job_id, job_env / "run", folder)
    assert_resumed_exactly_once(job_env / "run", 30)
    log = cli("logs", job_id)
    assert "Calling checkpoint method" in log and "Requeued job" in log and "Job completed successfully" in log
    assert_no_secrets(folder)


def with_one_retry(scenario: Callable[[Path], None], job_env: Path) -> None:
    """Run a preempt-and-resume scenario; if it fails, cancel its job, report the failure with its diagnosis as a
    warning (printed in pytest's summary, so a flake is seen and can be understood) and run it once more in a
    fresh folder, whose failure fails the test. Once in CI (and never in ~20 local runs) both scenarios' resumed
    runs did not finish within 300 s, with no diagnosis kept; this keeps one, without losing the submission."""
    try:
        scenario(job_env)
    except AssertionError as e:
        subprocess.run(["scancel", LAUNCHED[-1]], capture_output=True)
        warnings.warn(f"{scenario.__name__}: first attempt failed, retrying once: {e}", stacklevel=1)
        retry = job_env / "retry"
        retry.mkdir()
        scenario(retry)


@pytest.mark.timeout(1200)
def test_sbatch_requeue_resumes_from_checkpoint(job_env: Path) -> None:
    """The batch shell gets USR1 exactly as `--signal=B:USR1@lead` delivers it near the time limit."""
    with_one_retry(sbatch_requeue, job_env)


@pytest.mark.timeout(1200)
def test_submitit_two_node_job_requeue(job_env: Path) -> None:
    """The same job through submitit; preempted like submitit's own job._interrupt() (SIGTERM, then the
    preemption signal to every step): its Checkpointable hook waits for the engine's checkpoint, requeues."""
    with_one_retry(submitit_requeue, job_env)


@pytest.mark.slow
def test_sbatch_time_limit_signal_requeues(job_env: Path) -> None:
    """No manual signal: SLURM itself sends B:USR1 `--signal-lead` seconds before `--time`; the engine
    checkpoints and the job requeues itself. (The resume is the previous test's; here we stop at the requeue.)"""
    if os.environ.get("LLMCTL_SKIP_SLOW_SLURM") == "1":
        pytest.skip("LLMCTL_SKIP_SLOW_SLURM=1")
    plan = make_plan(job_env, max_steps=400, log_every=10)
    job_id, folder = launch(
        str(plan), "--slurm", "--nodes", "2", "--nproc-per-node", "1", "--time", "3", "--signal-lead", "110"
    )
    log = folder / f"slurm-{job_id}.out"
    # The signal comes 70-100 s after the start (the controller checks about every 30 s): well past the engine's
    # start-up even on a loaded machine (a rank that is signalled before it has installed its handler dies).
    try:
        wait_for("the time-limit requeue", lambda: job_events(folder), 240)
        show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    ev = events(job_env / "run")
    text = log.read_text() if log.is_file() else ""
    why = f"\nevents: {ev[-4:]}\nlog tail:\n{text[-3000:]}"
    assert job_events(folder)[0].startswith("requeued "), why
    assert "Restarts=1" in show, show
    assert "llmctl: SIGUSR1" in text, why
    stop = [e for e in ev if e["event"] == "stop"]
    assert len(stop) == 1 and stop[0]["reason"] == "signal", why
    assert any(e["event"] == "checkpoint" and e["step"] == stop[0]["step"] for e in ev), why
    assert 0 < stop[0]["step"] < 400


@pytest.mark.timeout(900)
def test_a_stalled_job_is_requeued_without_the_node_of_its_stuck_rank(
    job_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 50 on the real SLURM: rank 1 of a 2-node job sleeps before step 5 on node2 only (a bad node: the
    engine's test hook, keyed by SLURMD_NODENAME); `llmctl status` says STALLED naming node2; `llmctl requeue JOB`
    requeues it without node2; the next run, on node1 and node3, resumes from its checkpoint and finishes."""
    plan_path = make_plan(job_env, max_steps=8, log_every=1, ckpt_every=2)
    plan = yaml.safe_load(plan_path.read_text())
    plan["watchdog"] = {"stall_factor": 3, "stall_floor_s": 6, "collective_timeout_s": 900}
    plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    monkeypatch.setenv("LLMCTL_TEST_STALL", "1:5:900:node2")
    wait_for("idle nodes", nodes_idle, 120)
    job_id, folder = launch(str(plan_path), "--slurm", "--nodes", "2", "--nproc-per-node", "1")
    run_dir = job_env / "run"
    try:
        try:
            stalled = wait_for(
                "STALLED", lambda: next((ln for ln in cli("status").splitlines() if "STALLED:" in ln), ""), 300
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnosis(job_id, run_dir, folder)}") from None
        assert "behind: rank 1 (node node2 on " in stalled and "in data of step 5" in stalled, stalled
        said = cli("requeue", job_id)
        print(f"{stalled}\n{said}")  # docs/how-to/hangs.md shows this output
        assert said.strip().startswith(f"requeued job {job_id} without node2 ("), said
        wait_for("the requeue", lambda: squeue_state(job_id) in ("PENDING", "RUNNING") and job_events(folder), 120)
        start_now(job_id)
        wait_for_resumed_run(job_id, run_dir, folder, timeout_s=400)
        show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    assert "ExcNodeList=node2" in show, show
    nodes = [w.split("=", 1)[1] for w in show.split() if w.startswith("NodeList=")]  # the last run's (no sacct here)
    assert nodes in (["node[1,3]"], ["node1,node3"]), show
    requeued = [ln for ln in job_events(folder) if ln.startswith("requeued ")]
    assert len(requeued) == 1 and " without node2: STALLED: " in requeued[0], job_events(folder)
    ev = events(run_dir)
    starts = [e["step"] for e in ev if e["event"] == "start"]
    assert starts[0] == 0 and len(starts) == 2 and starts[1] in (4, 5), starts  # resumed from its checkpoint
    assert sorted(set(steps_logged(run_dir))) == list(range(1, 9))
    assert ev[-1]["event"] == "end" and ev[-1]["reason"] == "done" and ev[-1]["step"] == 8
