"""When too few nodes passed: requeue the job without the ones that failed, if the partition has others for it
(SLURM keeps the job id and its folder; the preflight of the next run checks the new nodes)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

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


def job_and_usable(job_id: str, env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(`scontrol show job` fields with ReqNodeList, ExcNodeList and NodeList as comma-separated names, the
    partition's nodes in a state a job can get)."""
    from llmctl.launch.jobs import query

    job = _job_fields(job_id)
    for key in ("ReqNodeList", "ExcNodeList", "NodeList"):
        job[key] = ",".join(_names_of(job.get(key)))
    part = job.get("Partition") or env.get("SLURM_JOB_PARTITION") or ""
    listing = query(["sinfo", "-h", "-N", "-p", part, "-o", "%N %t"]) if part else None
    rows = [ln.split() for ln in (listing or "").splitlines()]
    usable = sorted({r[0] for r in rows if len(r) == 2 and not r[1].rstrip("*~#!%$@^-").startswith(_UNUSABLE)})
    return job, usable


def max_requeues(env: dict[str, str]) -> int:
    try:
        return int(env.get("LLMCTL_MAX_REQUEUES") or 0)
    except ValueError:
        return 0


def requeue(ctx: JobContext, d: Decision, env: dict[str, str]) -> bool:
    """Requeue this job without `d.exclude` when the partition has the nodes for it; False (with the reason in the
    log) when it cannot. The requeue's kill (SIGTERM) is ignored until the exclude list is set on the pending job
    (SLURM changes a job's ExcNodeList only while it is pending)."""
    job, usable = job_and_usable(ctx.job_id, env)
    exclude, why = requeue_without(d, job, usable, int(ctx.restart or 0), max_requeues(env))
    if exclude is None:
        say(f"not requeued: {why}")
        return False
    # From here until this process exits: the requeue kills this run (SIGTERM), which must neither stop the update
    # below nor turn the preflight's exit code into 143 (the script would record the run as failed).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        said = requeue_excluding(ctx.job_id, exclude, ctx.job_dir / "events", f"restart {ctx.restart}", why)
    except RuntimeFailure as e:
        signal.signal(signal.SIGTERM, previous)
        say(f"not requeued: {e.message}")
        return False
    say(said)
    return True


def requeue_excluding(job_id: str, exclude: list[str], events: Path, restart: str, why: str, cause: str = "") -> str:
    """`scontrol requeue` the job, record it in its events (`requeued TIME restart R without NODES[: cause]`), and
    set its exclude list once it is pending again. Returns the line to show; RuntimeFailure when SLURM refused."""
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeFailure(f"scontrol requeue {job_id} failed: {one_line(out.stderr.strip() or '?')}")
    with open(events, "a") as f:
        f.write(f"requeued {now()} {restart} without {','.join(exclude)}{': ' + one_line(cause) if cause else ''}\n")
    for _ in range(40):  # pending within a moment of the requeue
        upd = subprocess.run(
            ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(exclude)}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if upd.returncode == 0:
            return f"requeued job {job_id} without {','.join(exclude)} ({why})"
        time.sleep(0.25)
    return f"requeued job {job_id}, but SLURM kept its nodes open: {one_line(upd.stderr.strip() or '?')}"
