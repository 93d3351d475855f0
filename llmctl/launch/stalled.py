"""`llmctl requeue JOB`: a stalled SLURM job requeued without the node(s) of its stuck rank(s) (issue 50).

A rank stuck on a bad node (a NIC, a GPU, a filesystem mount) holds every other rank in a collective until the plan's
timeout ends the run, and a plain requeue may land on the same node again. The ranks' heartbeats name the rank behind
and its SLURM node (SLURMD_NODENAME); this requeues the job (SLURM keeps its id, folder and checkpoints; the next run
resumes from the newest checkpoint) with that node added to its exclude list, the preflight's requeue path
(llmctl.launch.preflight.requeue), when the partition has enough other usable nodes. The job's `events` records why.
Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmctl.errors import InputError, RuntimeFailure
from llmctl.launch import jobs
from llmctl.launch.preflight.decision import Decision
from llmctl.launch.preflight.requeue import job_and_usable, requeue_excluding, requeue_without

SLURM_BACKENDS = ("sbatch", "submitit")


def stuck_nodes(record: jobs.JobRecord) -> tuple[list[str], str]:
    """(the SLURM nodes of the ranks behind, the stall's line) of a STALLED job; InputError when the heartbeats do
    not say which node to leave out."""
    found = record.diagnosis()
    if found is None:
        raise InputError(f"job {record.job_id}: no heartbeats yet (the engine has not started)")
    if not found.stalled:
        raise InputError(
            f"job {record.job_id} is not STALLED ({found.line()})",
            hint="to leave nodes out anyway, name them: llmctl requeue JOB --exclude NODE[,NODE]",
        )
    if not found.ahead:
        raise InputError(
            f"job {record.job_id}: every rank is at the same place, the heartbeats cannot tell the stuck one",
            hint=f"`llmctl status --stacks {record.job_id}` names it; then llmctl requeue JOB --exclude NODE",
        )
    unknown = [b.rank for b in found.behind if not b.node]
    if unknown:
        raise InputError(f"job {record.job_id}: rank {unknown[0]}'s heartbeat names no SLURM node (SLURMD_NODENAME)")
    return sorted({b.node for b in found.behind if b.node}), found.line()


def requeue_stalled(record: jobs.JobRecord, exclude: list[str] | None = None) -> str:
    """Requeue a running SLURM job without `exclude` (default: the stuck ranks' nodes). Returns the line to show."""
    if record.backend not in SLURM_BACKENDS:
        raise InputError(
            f"job {record.job_id} is a {record.backend} run, not a SLURM job",
            hint=f"`llmctl cancel {record.job_id}`, then launch it again (it resumes from its newest checkpoint)",
        )
    state = jobs.slurm_state(record.job_id)
    if state != "RUNNING":
        raise InputError(f"job {record.job_id} is {state or 'not known to SLURM'}, not RUNNING: nothing to requeue")
    cause = ""
    if exclude is None:
        exclude, cause = stuck_nodes(record)
    job, usable = job_and_usable(record.job_id, dict(os.environ))
    allocated = [n for n in job.get("NodeList", "").split(",") if n]
    unknown = sorted(set(exclude) - set(allocated) - set(usable))
    if unknown:
        raise InputError(f"--exclude {','.join(unknown)}: not a node of job {record.job_id} or its partition")
    restart = jobs.requeues(record)
    # Asked by the user: the job's own requeue limit (LLMCTL_MAX_REQUEUES, for automatic requeues) does not apply.
    d = Decision(allocated=allocated, needed=len(allocated), exclude=list(exclude))
    nodes, why = requeue_without(d, job, usable, restart, restart + 1)
    if nodes is None:
        raise RuntimeFailure(f"job {record.job_id} cannot be requeued without {','.join(exclude)}: {why}")
    return requeue_excluding(record.job_id, nodes, Path(record.folder) / jobs.EVENTS, f"restart {restart}", why, cause)
