"""The preflight on the real single-host SLURM (3 fake nodes, the `slurm_cluster` fixture). A healthy 2-node job
passes it and trains: tests/launch/test_slurm.py::test_sbatch_two_node_job_finishes_with_metrics. Here a node whose
check fails (the LLMCTL_PREFLIGHT_FAIL_NODE test hook, llmctl.netbench.quick) is left out for the spare of a 3-node
allocation; without a spare, the job requeues itself without it when the partition has other nodes, and stops with
one line naming it when it cannot (its nodes are pinned with --nodelist).

The spare and the stop pin their nodes with --sbatch-arg=--nodelist, so that the failing node is in the allocation
whatever the scheduler would have picked (the requeue cannot: a job that names a node cannot leave it out). The cluster is stopped by the fixture even when a test fails; a job still
queued when a test fails is cancelled by `cancel_on_failure`."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_slurm import (
    cli,
    diagnosis,
    events,
    job_env,
    launch,
    make_plan,
    squeue_state,
    start_now,
    steps_logged,
    wait_for,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
__all__ = ["job_env"]  # the fixture, imported for the tests below

HOOK = "LLMCTL_PREFLIGHT_FAIL_NODE"
LAUNCHED: list[str] = []


@pytest.fixture(autouse=True)
def cancel_on_failure() -> Iterator[None]:
    LAUNCHED.clear()
    yield
    for job_id in LAUNCHED:
        if squeue_state(job_id) not in ("", "?"):
            subprocess.run(["scancel", job_id], capture_output=True)


def submit(job_env: Path, *args: str) -> tuple[str, Path]:
    plan = make_plan(job_env, max_steps=2, log_every=1)
    job_id, folder = launch(str(plan), "--slurm", "--nproc-per-node", "1", "--time", "10", "--signal-lead", "60", *args)
    LAUNCHED.append(job_id)
    return job_id, folder


def wait_until_done(job_id: str, job_env: Path, folder: Path, timeout_s: float = 200) -> str:
    try:
        wait_for("the job to end", lambda: squeue_state(job_id) == "", timeout_s, every_s=1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diagnosis(job_id, job_env / 'run', folder)}") from None
    return (folder / f"slurm-{job_id}.out").read_text()


def preflight_result(folder: Path, job_id: str) -> dict:
    result = json.loads((folder / "preflight" / f"{job_id}.0" / "result.json").read_text())
    print(f"preflight of job {job_id}: {result['seconds']:.1f} s for {len(result['allocated'])} nodes")
    return result


def test_failed_node_is_left_out_for_the_spare(job_env: Path) -> None:
    job_id, folder = submit(
        job_env,
        "--nodes",
        "2",
        "--spare-nodes",
        "1",
        "--sbatch-arg=--nodelist=node1,node2,node3",
        "--env",
        f"{HOOK}=node2",
    )
    log = wait_until_done(job_id, job_env, folder)
    why = f"\n{log[-4000:]}"
    assert f"llmctl: preflight: node2: FAILED: failing on purpose: {HOOK} names node2 (a test hook)" in log, why
    assert "llmctl: preflight: all-reduce across 2 nodes" in log and "pair node1-node3" in log, why
    assert "on node1,node3, rendezvous 127.0.0.1:" in log, why
    lines = (folder / "events").read_text().splitlines()
    assert lines[0].startswith("preflight ok ") and lines[0].endswith(
        f"training on node1,node3; dropped node2 (failed: failing on purpose: {HOOK} names node2 (a test hook))"
    ), lines
    assert lines[-1].startswith("exit 0 "), lines
    result = preflight_result(folder, job_id)
    assert result["allocated"] == ["node1", "node2", "node3"] and result["train"] == ["node1", "node3"]
    start = next(e for e in events(job_env / "run") if e["event"] == "start")
    assert start["world_size"] == 2
    assert steps_logged(job_env / "run") == [1, 2]
    status = cli("status", job_id)
    assert "2x1 +1 spare" in status and "dropped node2" in status


def test_failed_node_without_spare_stops_with_one_line(job_env: Path) -> None:
    job_id, folder = submit(job_env, "--nodes", "2", "--sbatch-arg=--nodelist=node1,node2", "--env", f"{HOOK}=node2")
    log = wait_until_done(job_id, job_env, folder, timeout_s=150)
    expected = (
        f"llmctl: preflight failed: node2 failed: failing on purpose: {HOOK} names node2 (a test hook); "
        "1 of 2 nodes left, the plan needs 2 (relaunch with node2 in --exclude, or with --spare-nodes 1)"
    )
    assert [ln for ln in log.splitlines() if ln.startswith("llmctl: preflight failed")] == [expected], log[-4000:]
    assert "llmctl: preflight ended with exit code 1" in log
    assert "rendezvous" not in log  # training never started
    assert not (job_env / "run" / "metrics.jsonl").exists()
    lines = (folder / "events").read_text().splitlines()
    assert [ln.split(" ")[:2] for ln in lines] == [["preflight", "failed"], ["exit", "1"]], lines
    status = cli("status", job_id)
    assert "FAILED" in status and "failed: node2 failed" in status


def test_failed_node_requeues_the_job_without_it(job_env: Path) -> None:
    """No spare and no --nodelist: the first run lands on node1 and node2 (the scheduler's first idle nodes), node2
    fails, and the preflight requeues the job without it; the second run gets node1 and node3 and trains."""
    job_id, folder = submit(job_env, "--nodes", "2", "--env", f"{HOOK}=node2")
    events_file = folder / "events"
    wait_for("the requeue", lambda: events_file.is_file() and "requeued " in events_file.read_text(), 150)
    # SLURM holds a requeued job ~2 min (BeginTime); a test need not wait for that. start_now acts on a pending job
    # only: wait until the requeue has taken the job out of RUNNING/COMPLETING first.
    wait_for("the requeued job to be pending", lambda: squeue_state(job_id) == "PENDING", 60)
    start_now(job_id)
    log = wait_until_done(job_id, job_env, folder, timeout_s=250)
    why = f"\n{log[-4000:]}"
    first = json.loads((folder / "preflight" / f"{job_id}.0" / "result.json").read_text())
    assert first["allocated"] == ["node1", "node2"] and first["exclude"] == ["node2"], first
    assert f"llmctl: preflight: requeued job {job_id} without node2 (" in log, why
    second = json.loads((folder / "preflight" / f"{job_id}.1" / "result.json").read_text())
    assert second["allocated"] == ["node1", "node3"] and second["train"] == ["node1", "node3"], second
    assert "on node1,node3, rendezvous 127.0.0.1:" in log, why
    assert steps_logged(job_env / "run") == [1, 2]
    lines = (folder / "events").read_text().splitlines()
    kinds = [" ".join(ln.split(" ")[:2]) for ln in lines]
    assert kinds[0] == "preflight failed" and lines[1].startswith("requeued ") and lines[1].endswith("without node2")
    assert kinds[2:] == ["preflight ok", "exit 0"], lines
    status = cli("status", job_id)
    assert "COMPLETED" in status and "ok: training on node1,node3" in status
