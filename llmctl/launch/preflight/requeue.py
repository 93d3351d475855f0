"""When too few nodes passed: requeue the job without the ones that failed, if the partition has others for it
(SLURM keeps the job id and its folder; the preflight of the next run checks the new nodes)."""

from __future__ import annotations

import signal
import subprocess
import time

from llmctl.errors import RuntimeFailure, one_line
from llmctl.launch.preflight.decision import Decision, nodelist
from llmctl.launch.preflight.job import JobContext, now, say

REQUEUED_EXIT = 3
"""The preflight's exit code when it has requeued the job without the nodes that failed (the script then exits 0)."""
_UNUSABLE = ("down", "drain", "drng", "fail", "maint", "unk", "inval", "futr", "plnd", "npc", "boot", "powered")
"""sinfo %t node states (prefixes) a requeued job cannot count on."""


def _job_fields(job_id: str) -> dict[str, str]:
    from llmctl.launch.jobs import query

    out = query(["scontrol", "show", "job", job_id]) or ""
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _names_of(hostlist: str | None) -> list[str]:
    """The node names in a SLURM hostlist expression (`node[1-3]`); none for an empty or unreadable one."""
    from llmctl.launch.jobs import hostnames

    if not hostlist or hostlist == "(null)":
        return []
    try:
        return hostnames(hostlist)
    except RuntimeFailure:
        return []


def requeue_without(
    d: Decision, job: dict[str, str], usable: list[str], restart: int, max_requeues: int
) -> tuple[list[str] | None, str]:
    """Whether the job can run again without the nodes `d` excludes: (its new exclude list, why) or (None, why not).
    `job`: `scontrol show job` fields (ReqNodeList and ExcNodeList expanded to names); `usable`: the partition's nodes
    in a state a job can get. Pure."""
    if not d.exclude:
        return None, "nothing to leave out"
    if restart >= max_requeues:
        return None, f"requeued {restart} times already (the limit)"
    asked = set(job.get("ReqNodeList", "").split(",")) - {""}
    if asked & set(d.exclude):
        return None, f"the job asks for {nodelist(sorted(asked & set(d.exclude)))} by name (--nodelist)"
    exclude = sorted(set(job.get("ExcNodeList", "").split(",")) - {""} | set(d.exclude))
    others = [n for n in usable if n not in exclude]
    if len(others) < len(d.allocated):
        return None, f"the partition has {len(others)} other usable node(s), the job needs {len(d.allocated)}"
    return exclude, f"{len(others)} usable node(s) left in the partition"


def requeue(ctx: JobContext, d: Decision, env: dict[str, str]) -> bool:
    """Requeue this job without `d.exclude` when the partition has the nodes for it; False (with the reason in the
    log) when it cannot. The requeue's kill (SIGTERM) is ignored until the exclude list is set on the pending job
    (SLURM changes a job's ExcNodeList only while it is pending)."""
    from llmctl.launch.jobs import query

    job = _job_fields(ctx.job_id)
    for key in ("ReqNodeList", "ExcNodeList"):
        job[key] = ",".join(_names_of(job.get(key)))
    part = job.get("Partition") or env.get("SLURM_JOB_PARTITION") or ""
    listing = query(["sinfo", "-h", "-N", "-p", part, "-o", "%N %t"]) if part else None
    rows = [ln.split() for ln in (listing or "").splitlines()]
    usable = sorted({r[0] for r in rows if len(r) == 2 and not r[1].rstrip("*~#!%$@^-").startswith(_UNUSABLE)})
    try:
        limit = int(env.get("LLMCTL_MAX_REQUEUES") or 0)
    except ValueError:
        limit = 0
    exclude, why = requeue_without(d, job, usable, int(ctx.restart or 0), limit)
    if exclude is None:
        say(f"not requeued: {why}")
        return False
    # From here until this process exits: the requeue kills this run (SIGTERM), which must neither stop the update
    # below nor turn the preflight's exit code into 143 (the script would record the run as failed).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = subprocess.run(["scontrol", "requeue", ctx.job_id], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        signal.signal(signal.SIGTERM, previous)
        say(f"not requeued: scontrol requeue failed: {one_line(out.stderr.strip() or '?')}")
        return False
    with open(ctx.job_dir / "events", "a") as f:
        f.write(f"requeued {now()} restart {ctx.restart} without {','.join(exclude)}\n")
    for _ in range(40):  # pending within a moment of the requeue
        upd = subprocess.run(
            ["scontrol", "update", f"JobId={ctx.job_id}", f"ExcNodeList={','.join(exclude)}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if upd.returncode == 0:
            say(f"requeued job {ctx.job_id} without {','.join(exclude)} ({why})")
            return True
        time.sleep(0.25)
    say(f"requeued job {ctx.job_id}, but SLURM kept its nodes open: {one_line(upd.stderr.strip() or '?')}")
    return True
