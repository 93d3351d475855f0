"""Job folders: one per launch, holding the plan copy, the script, the logs and a `job.json` record, so that
`llmctl status`, `logs` and `cancel` work for jobs launched from here: they ask the backend named in the record
(llmctl.launch.backends), which uses squeue/sacct/scontrol or a pid, else what the folder says. Torch-free.

Layout of <jobs-dir>/<stamp>-<name>/: plan.yaml, job.sbatch (sbatch) or submitit/ (submitit), slurm-<id>.out,
events (lines appended by the job: "exit N ...", "requeued ..." or "preflight ok|warning|failed ..."), job.json,
preflight/ (the preflight's results: llmctl.launch.preflight).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmctl.errors import InputError, RuntimeFailure
from llmctl.fileio import write_atomic
from llmctl.launch import shell

RECORD = "job.json"
DEFAULT_JOBS_DIR = "llmctl-jobs"


def jobs_root(given: str | None = None) -> Path:
    """--jobs-dir, else $LLMCTL_JOBS_DIR, else ./llmctl-jobs."""
    return Path(given or os.environ.get("LLMCTL_JOBS_DIR") or DEFAULT_JOBS_DIR).absolute()


@dataclass
class JobRecord:
    job_id: str
    backend: str
    """The launch backend's name ("local", "sbatch", "submitit" or a registered one): it answers status/logs."""
    folder: str
    plan_name: str
    nodes: int
    nproc_per_node: int
    submitted_at: str
    logs: list[str] = field(default_factory=list)
    """Log files (absolute); SLURM's %j already substituted."""
    command: list[str] = field(default_factory=list)
    """The submission command (no environment: nothing secret)."""
    spare_nodes: int = 0
    """Nodes asked for beyond `nodes` (`--spare-nodes`): the preflight leaves out as many."""
    pid: int | None = None
    """Local runs: torchrun's pid, with its start time (`pid_start`) and `host` to tell it from a reused pid."""
    pid_start: str | None = None
    host: str | None = None

    def save(self) -> None:
        write_atomic(Path(self.folder) / RECORD, json.dumps(asdict(self), indent=2) + "\n")


def new_folder(root: Path, name: str) -> Path:
    """A fresh job folder under root named <UTC stamp>-<safe name>-<random>."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    folder = root / f"{stamp}-{shell.safe_name(name, 32)}-{secrets.token_hex(2)}"
    folder.mkdir(parents=True, exist_ok=False)
    return folder


def load(folder: Path) -> JobRecord:
    data = json.loads((folder / RECORD).read_text())
    return JobRecord(**data)


def all_records(root: Path) -> list[JobRecord]:
    if not root.is_dir():
        return []
    out = []
    for rec in sorted(root.glob(f"*/{RECORD}")):
        try:
            out.append(load(rec.parent))
        except (OSError, ValueError, TypeError):
            continue
    return out


def find(job: str, root: Path) -> JobRecord:
    """A job by id (SLURM's, or local-<pid>), folder name or folder path. The newest folder wins if an id was reused."""
    p = Path(job)
    if (p / RECORD).is_file():
        return load(p)
    matches = [r for r in all_records(root) if job in (r.job_id, Path(r.folder).name)]
    if not matches:
        raise InputError(f"no job {job!r} launched from {root}", hint="see `llmctl status` for the list")
    return matches[-1]


def query(argv: list[str]) -> str | None:
    """A SLURM command's output, or None when it fails or is missing."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def slurm_state(job_id: str) -> str | None:
    """The job's state from squeue (queued/running), else sacct, else scontrol (recently finished)."""
    out = query(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if out and out.strip():
        return out.split()[0]
    out = query(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    if out and out.strip():
        return out.split()[0].rstrip("+")
    out = query(["scontrol", "show", "job", job_id])
    if out:
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
    return None


def hostnames(nodelist: str) -> list[str]:
    """A SLURM node list (node[1-3]) as names, by `scontrol show hostnames`."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode != 0 or not out.stdout.split():
        raise RuntimeFailure(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()[:200]}")
    return out.stdout.split()


def node_addr(node: str) -> str | None:
    """A SLURM node's address (NodeAddr): node names need not resolve, and fake nodes share one host name."""
    out = query(["scontrol", "show", "node", node])
    for word in (out or "").split():
        if word.startswith("NodeAddr="):
            return word.split("=", 1)[1]
    return None


def preflight_note(record: JobRecord) -> str:
    """The last preflight line of the job's events (llmctl.launch.preflight), shortened: "ok: training on ...",
    "failed: ...", "warning: ..."; "" when the job had none."""
    events = Path(record.folder) / "events"
    if not events.is_file():
        return ""
    lines = [ln for ln in events.read_text().split("\n") if ln.startswith("preflight ")]
    if not lines:
        return ""
    words = lines[-1].split(" ", 5)  # preflight KIND TIME restart R: text
    if len(words) < 6:
        return ""
    return f"{words[1]}: {words[5]}"


def scancel(job_id: str) -> None:
    """Cancel a SLURM job (SIGTERM to its steps, then SIGKILL; the sbatch script does not requeue on it)."""
    try:
        out = subprocess.run(["scancel", job_id], capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise RuntimeFailure("scancel not found", hint="run on a SLURM login node") from None
    except subprocess.TimeoutExpired:
        raise RuntimeFailure("scancel did not answer within 30 s") from None
    if out.returncode != 0:
        msg = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuntimeFailure(f"scancel {job_id} failed: {msg}")


def folder_state(record: JobRecord) -> str:
    """What the job folder says: the last line the batch script appended to `events`."""
    events = Path(record.folder) / "events"
    if events.is_file():
        lines = events.read_text().split("\n")
        last = next((ln for ln in reversed(lines) if ln.strip()), "")
        if last.startswith("exit "):
            code = last.split()[1]
            return "COMPLETED" if code == "0" else f"FAILED (exit {code})"
        if last.startswith("requeued"):
            return "REQUEUED"
    result = list((Path(record.folder) / "submitit").glob("*_result.pkl"))
    if result:
        return "FINISHED"
    return "UNKNOWN"


ACTIVE = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SUSPENDED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
}
