"""`llmctl requeue JOB` (llmctl.launch.stalled): a STALLED SLURM job requeued without the node of its rank behind,
with SLURM's commands stubbed (the real single-host SLURM case is in tests/launch/test_slurm.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from launch_helpers import write_stub
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import heartbeat, jobs

SHOW_JOB = "JobId=7 JobName=t Partition=debug NodeList=node[1-2] ReqNodeList=(null) ExcNodeList=(null) Restarts=0"


def _job(tmp_path: Path, backend: str = "sbatch") -> jobs.JobRecord:
    folder = tmp_path / "jobs" / "job7"
    folder.mkdir(parents=True)
    run = tmp_path / "run"
    (run / "heartbeats").mkdir(parents=True)
    record = jobs.JobRecord(
        "7",
        backend,
        str(folder),
        "t",
        2,
        1,
        "2026-11-29T10:00:00Z",
        metrics=str(run / "metrics.jsonl"),
        stall={"step_s": 1.0, "factor": 3.0, "floor_s": 5.0},
    )
    (folder / jobs.RECORD).write_text(json.dumps(record.__dict__))
    return record


def _beats(record: jobs.JobRecord, places: dict[int, tuple[int, str, str | None]], age_s: float = 60) -> None:
    run = Path(record.metrics).parent
    for rank, (step, phase, node) in places.items():
        beat = heartbeat.Beat(rank, step, phase, time.time() - age_s, "vm", 100 + rank, 1.0, node)
        heartbeat.path_of(run, rank).write_text(json.dumps(beat.__dict__))


def _stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sinfo: str, show_job: str = SHOW_JOB) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"
    log = f'echo "$(basename "$0") $*" >> {calls}'
    write_stub(bindir, "squeue", f"{log}\necho RUNNING")
    write_stub(
        bindir,
        "scontrol",
        f"""{log}
case "$1 $2" in
  "show job") echo "{show_job}" ;;
  "show hostnames") case "$3" in "node[1-2]") printf 'node1\\nnode2\\n' ;; *) echo "$3" | tr , '\\n' ;; esac ;;
esac""",
    )
    write_stub(bindir, "sinfo", f"{log}\nprintf '{sinfo}'")
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    return calls


def _requeue(record: jobs.JobRecord, *args: str):
    return CliRunner().invoke(app, ["requeue", record.folder, *args])


THREE = "node1 alloc\\nnode2 alloc\\nnode3 idle\\n"


def test_a_stalled_job_is_requeued_without_the_node_of_its_rank_behind(tmp_path, monkeypatch):
    record = _job(tmp_path)
    _beats(record, {0: (5, "forward", "node1"), 1: (4, "data", "node2")})
    calls = _stubs(tmp_path, monkeypatch, THREE)
    r = _requeue(record)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == "requeued job 7 without node2 (2 usable node(s) left in the partition)"
    said = calls.read_text().splitlines()
    # the requeue first, then the exclude list on the pending job (SLURM changes it only then)
    assert said.index("scontrol requeue 7") < said.index("scontrol update JobId=7 ExcNodeList=node2")
    (event,) = jobs.events(record)
    assert event.startswith("requeued ") and " restart 0 without node2: STALLED: " in event
    assert "behind: rank 1 (node node2 on vm, pid 101) in data of step 5" in event


def test_exclude_names_the_nodes_by_hand_and_joins_the_jobs_own_exclude_list(tmp_path, monkeypatch):
    record = _job(tmp_path)
    _beats(record, {0: (5, "forward", "node1"), 1: (5, "forward", "node2")}, age_s=1)  # moving: not stalled
    show_job = SHOW_JOB.replace("ExcNodeList=(null)", "ExcNodeList=node4")
    calls = _stubs(tmp_path, monkeypatch, THREE + "node4 down\\n", show_job)
    r = _requeue(record)
    assert r.exit_code == 2 and "job 7 is not STALLED (moving" in r.output and "--exclude NODE" in r.output
    r = _requeue(record, "--exclude", "node1")
    assert r.exit_code == 0, r.output
    assert "scontrol update JobId=7 ExcNodeList=node1,node4" in calls.read_text()
    r = _requeue(record, "--exclude", "node9")
    assert r.exit_code == 2 and "--exclude node9: not a node of job 7 or its partition" in r.output


@pytest.mark.parametrize(
    ("backend", "places", "sinfo", "code", "message"),
    [
        ("local", {0: (5, "forward", None), 1: (4, "data", None)}, THREE, 2, "job 7 is a local run, not a SLURM job"),
        (
            "sbatch",
            {0: (4, "forward", "node1"), 1: (4, "forward", "node2")},
            THREE,
            2,
            "every rank is at the same place, the heartbeats cannot tell the stuck one",
        ),
        ("sbatch", {0: (5, "forward", None), 1: (4, "data", None)}, THREE, 2, "rank 1's heartbeat names no SLURM node"),
        (
            "sbatch",
            {0: (5, "forward", "node1"), 1: (4, "data", "node2")},
            "node1 alloc\\nnode2 alloc\\nnode3 drain\\n",
            1,
            "job 7 cannot be requeued without node2: the partition has 1 other usable node(s), the job needs 2",
        ),
    ],
    ids=["local", "same-place", "no-node", "too-few-nodes"],
)
def test_what_cannot_be_requeued_is_one_line(tmp_path, monkeypatch, backend, places, sinfo, code, message):
    record = _job(tmp_path, backend)
    _beats(record, places)
    calls = _stubs(tmp_path, monkeypatch, sinfo)
    r = _requeue(record)
    assert r.exit_code == code and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert "requeue" not in (calls.read_text() if calls.exists() else "")  # nothing was requeued
    assert jobs.events(record) == []
