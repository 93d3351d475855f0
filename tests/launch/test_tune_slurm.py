"""`llmctl tune --slurm` on the real single-host SLURM (the `slurm_cluster` fixture, 3 fake nodes): one allocation
of 2 nodes runs three trials of the tiny Llama one after another (2 nodes x 1 gloo rank each), the second made to
crash by the LLMCTL_TUNE_FAIL_TRIALS hook; the command follows the job, reports every trial, and writes the measured
best. A job still running when the test fails is cancelled by name."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_slurm import job_env, make_plan
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.tune import trials as tune_plans

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]
__all__ = ["job_env"]  # the fixture, imported for the test below

JOB_NAME = "tune-tiny-cpu"


@pytest.fixture(autouse=True)
def cancel_on_failure() -> Iterator[None]:
    yield
    subprocess.run(["scancel", "--name", JOB_NAME], capture_output=True)


def test_trials_run_one_after_another_in_one_two_node_allocation(job_env: Path, monkeypatch) -> None:
    plan = make_plan(job_env, max_steps=2)
    data = yaml.safe_load(plan.read_text())
    data["hardware"].update(nodes=2, nproc_per_node=1)
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.setenv(tune_plans.FAIL_ENV, "2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    space = ["--micro-batch", "4,8", "--checkpointing", "none,full", "--no-compile", "--strategy", "full_shard"]
    args = [
        "tune",
        str(plan),
        "--slurm",
        "--time",
        "10",
        "--signal-lead",
        "60",
        "--top",
        "3",
        "--steps",
        "2",
        "--inter-gbps",
        "10",
    ]
    r = CliRunner().invoke(app, [*args, "--warmup", "1", *space, "-o", "best.yaml", "--dir", "trials", "--json"])
    why = f"\n{r.output[-3000:]}"
    logs = list((job_env / "trials").glob("*/slurm-*.out"))
    if logs:
        why += f"\njob log:\n{logs[0].read_text()[-3000:]}"
    assert r.exit_code == 0, why
    report = json.loads(r.stdout)
    trials = report["trials"]
    assert [t["label"] for t in trials] == [
        "full_shard 8x1 ckpt none",
        "full_shard 4x2 ckpt none",
        "full_shard 8x1 ckpt full",
    ], why
    assert [t["status"] for t in trials] == ["ok", "failed", "ok"], why
    assert trials[1]["reason"].startswith("exit "), trials[1]["reason"]
    assert report["nodes"] == 2 and report["best_trial"] in (1, 3)
    # The job ran the trials on both nodes: each ok trial's engine saw a world of 2 (one rank per node).
    for t in (trials[0], trials[2]):
        records = [json.loads(line) for line in (Path(t["folder"]) / "logs" / "metrics.jsonl").read_text().splitlines()]
        start = next(e for e in records if e.get("event") == "start")
        assert start["world_size"] == 2, start
        assert t["measured"]["tokens_per_s"] > 0 and t["measured"]["steps"] == 2
    log = logs[0].read_text()
    assert "llmctl: tune: 3 trial(s) x 1 round(s) on node1,node2 (1 rank(s) each)" in log, why
    assert "llmctl: tune: trial 2/3 (full_shard 4x2 ckpt none): failed: exit " in log, why
    best = yaml.safe_load((job_env / "best.yaml").read_text())
    assert best["hardware"]["nodes"] == 2
    assert best["training"]["micro_batch_size"] == 8
    assert (job_env / "best.tune.json").is_file()
    # Progress lines on stderr (not a terminal): the job's state, each trial's start and end.
    assert "submitted tune job " in r.stderr and "trial 1/3 full_shard 8x1 ckpt none: running" in r.stderr, why
