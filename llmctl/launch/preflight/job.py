"""The preflight's SLURM job as the batch host and the agents see it: what the batch script exports (`JobContext`),
the files of one preflight in the job folder, and its lines in the job log and the events file."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llmctl.childerrors import ChildErrors
from llmctl.errors import InputError, one_line

PORT_OFFSET = 2000
"""The cross step's rendezvous port is the training's plus this: the training ports span 2000 (the template
derives them from the job id), so a preflight never takes another job's training port."""


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def say(line: str) -> None:
    """A line in the job log (stderr: stdout carries the node list to the script)."""
    print(f"llmctl: preflight: {one_line(line)}", file=sys.stderr, flush=True)


def event(job_dir: Path, kind: str, restart: str, text: str) -> None:
    with open(job_dir / "events", "a") as f:
        f.write(f"preflight {kind} {now()} restart {restart}: {one_line(text)}\n")


def step_errors(out: Path, step: str, node: str) -> ChildErrors:
    """$LLMCTL_ERROR_FILE of a step's ranks: one per node for the node step, one for the cross step (its agents set
    it, the batch host reads it)."""
    return ChildErrors(out / (f"node-{node}.errors.jsonl" if step == "node" else "cross.errors.jsonl"))


def log_path(out: Path, step: str, node: str) -> Path:
    """The output of a node's torchrun in a step (its agent redirects it there)."""
    return out / f"{step}-{node}.log"


@dataclass(frozen=True)
class JobContext:
    """What the batch script exports (templates/slurm.sbatch.j2) and SLURM sets, read once."""

    job_dir: Path
    plan_path: Path
    job_id: str
    restart: str
    nodelist: str
    rdzv_port: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> JobContext:
        env = dict(os.environ) if env is None else env
        missing = [
            k
            for k in ("LLMCTL_JOB_DIR", "LLMCTL_PLAN", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "LLMCTL_RDZV_PORT")
            if not env.get(k)
        ]
        if missing:
            raise InputError(
                f"not inside an llmctl sbatch job ({', '.join(missing)} unset)",
                hint="the preflight runs from the script `llmctl launch --slurm` writes",
            )
        return cls(
            job_dir=Path(env["LLMCTL_JOB_DIR"]),
            plan_path=Path(env["LLMCTL_PLAN"]),
            job_id=env["SLURM_JOB_ID"],
            restart=env.get("SLURM_RESTART_COUNT", "0") or "0",
            nodelist=env["SLURM_JOB_NODELIST"],
            rdzv_port=int(env["LLMCTL_RDZV_PORT"]) + PORT_OFFSET,
        )
