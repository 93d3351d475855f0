"""The job's resources and environment on the real single-host SLURM (the `slurm_cluster` fixture: fake nodes of
2 CPUs and 2000 MB): a 2-node job that takes whole nodes (--exclusive, --mem=0 on nodes with little memory), makes
its environment with --setup and gets a token by name, passes the preflight and trains to its end. Each --setup line
runs on the batch host and again in each node's step, whose task gets the node's CPUs (srun -c from
SRUN_CPUS_PER_TASK)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_slurm import SECRETS, assert_no_secrets, events, job_env, launch, make_plan, squeue_state, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]
__all__ = ["job_env"]  # the fixture, imported for the test below

PROBE = (
    'echo "setup node=${SLURMD_NODENAME:-?} step=${SLURM_STEP_ID:-batch} cpus=${SLURM_CPUS_PER_TASK:-none} '
    'token=${HF_TOKEN:+set}" >> "$LLMCTL_JOB_DIR/setup.log"'
)


def test_whole_nodes_with_setup_and_a_token_by_name(job_env: Path) -> None:
    plan = make_plan(job_env, max_steps=4, log_every=2)
    job_id, folder = launch(
        str(plan),
        "--slurm",
        "--nodes",
        "2",
        "--nproc-per-node",
        "1",
        "--time",
        "10",
        "--signal-lead",
        "60",
        "--exclusive",
        "--mem",
        "0",
        "--setup",
        "export LLMCTL_TEST_HOME=$LLMCTL_JOB_DIR",
        "--setup",
        PROBE,
        "--env",
        "HF_TOKEN",
    )
    script = (folder / "job.sbatch").read_text()
    assert "#SBATCH --exclusive" in script and "#SBATCH --mem=0" in script
    wait_for("the job to end", lambda: squeue_state(job_id) == "", 240)
    log = (folder / f"slurm-{job_id}.out").read_text() if (folder / f"slurm-{job_id}.out").is_file() else ""
    ev = events(job_env / "run")
    assert ev and ev[-1]["event"] == "end" and ev[-1]["reason"] == "done", log[-3000:]
    assert "llmctl: preflight: training on node1,node2" in log, log[-3000:]
    setup = (folder / "setup.log").read_text().splitlines()
    batch = [ln for ln in setup if "step=batch" in ln]
    steps = sorted(ln for ln in setup if "step=batch" not in ln)
    assert len(batch) == 1 and "token=set" in batch[0], setup
    # Once in each node's step, each task with all of its node's CPUs (2 on the fake nodes), the token there too.
    assert [ln.split()[1] for ln in steps] == ["node=node1", "node=node2"], setup
    assert all("cpus=2" in ln and "token=set" in ln for ln in steps), setup
    assert SECRETS["HF_TOKEN"] not in script
    assert_no_secrets(folder)
