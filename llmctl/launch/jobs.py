"""Job folders: one per launch, holding the plan copy, the script, the logs and a `job.json` record, and the
per-user index that points at them (llmctl.launch.registry), so that `llmctl status`, `logs` and `cancel` work from
any folder: they ask the backend named in the record (llmctl.launch.backends), which uses squeue/sacct/scontrol or a
pid, and what the folder's `events` say. Torch-free.

Layout of <jobs-dir>/<stamp>-<name>/: plan.yaml, job.sbatch (sbatch) or submitit/ (submitit), slurm-<id>.out
(sbatch) or console.log (local: what the console showed), job.json, preflight/ (llmctl.launch.preflight), and
`events`, one line appended per happening, its first word saying what:
    exit N TIME restart R             the run ended with exit code N (the sbatch script, or a local launch)
    requeued TIME restart R           the job checkpointed on SIGUSR1 and was requeued (the sbatch script)
    cancel-requested TIME             `llmctl cancel` asked a local run's ranks to checkpoint and stop
    cancelled TIME [step S] [checkpoint C] [exit N]   the job was cancelled (`llmctl cancel`)
    preflight ok|warning|failed ...   the preflight's verdict
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from llmctl.errors import InputError, RuntimeFailure
from llmctl.fileio import write_atomic
from llmctl.launch import heartbeat, registry, shell

RECORD = "job.json"
EVENTS = "events"
DEFAULT_JOBS_DIR = "llmctl-jobs"
CANCEL_REQUESTED = "cancel-requested"
CANCELLED = "cancelled"


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
    metrics: str | None = None
    """The engine's metrics.jsonl (absolute): the plan's logging.dir as seen from the launch's folder."""
    checkpoint_dir: str | None = None
    """The plan's checkpoint.dir (absolute), None without checkpoints: `status` shows its latest step."""
    stall: dict[str, float | None] | None = None
    """The plan's watchdog for `status`: {"step_s": predicted step time, "factor": ..., "floor_s": ...}."""

    def diagnosis(self, now: float | None = None) -> heartbeat.Diagnosis | None:
        """What the ranks' heartbeats say (llmctl.launch.heartbeat), None without them."""
        if not self.metrics:
            return None
        w = self.stall or {}
        return heartbeat.diagnose(
            heartbeat.read_all(Path(self.metrics).parent),
            now,
            planned_step_s=w.get("step_s"),
            factor=w.get("factor") or heartbeat.DEFAULT_FACTOR,
            floor_s=w.get("floor_s") or heartbeat.DEFAULT_FLOOR_S,
        )

    def save(self) -> None:
        """Write job.json and the job's entry in the per-user index (a failure there is a warning: the job runs)."""
        write_atomic(Path(self.folder) / RECORD, json.dumps(asdict(self), indent=2) + "\n")
        entry = registry.Entry(self.job_id, self.backend, self.folder, self.plan_name, self.submitted_at)
        try:
            registry.register(entry)
        except OSError as e:
            print(
                f"llmctl: warning: could not register job {self.job_id} in {registry.index_dir()} ({e.strerror}):"
                f" status/logs/cancel will find it only with --jobs-dir {shell.quote(str(Path(self.folder).parent))}",
                file=sys.stderr,
                flush=True,
            )


def new_folder(root: Path, name: str) -> Path:
    """A fresh job folder under root named <UTC stamp>-<safe name>-<random>."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    folder = root / f"{stamp}-{shell.safe_name(name, 32)}-{secrets.token_hex(2)}"
    folder.mkdir(parents=True, exist_ok=False)
    return folder


def load(folder: Path) -> JobRecord:
    data = json.loads((folder / RECORD).read_text())
    known = {f.name for f in fields(JobRecord)}
    return JobRecord(**{k: v for k, v in data.items() if k in known})  # a newer llmctl's extra keys: ignored


def _order(r: JobRecord) -> tuple[str, str]:
    return (r.submitted_at, r.folder)


def all_records(root: Path) -> list[JobRecord]:
    """The jobs whose folders are under root, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for rec in root.glob(f"*/{RECORD}"):
        try:
            out.append(load(rec.parent))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=_order)


@dataclass
class Listing:
    """The jobs `status`, `logs` and `cancel` know (oldest first), and the registered ones whose folder is gone."""

    records: list[JobRecord]
    gone: list[registry.Entry]
    where: str
    """Where they were looked for, for messages: the --jobs-dir root, or the index."""

    def note(self) -> str:
        """One line about the registered jobs skipped because their folder was deleted ("" when none)."""
        if not self.gone:
            return ""
        last = self.gone[-1]
        return (
            f"note: skipped {len(self.gone)} registered job(s) whose folder is gone (latest: {last.job_id},"
            f" {shell.quote(last.folder)}); their entries are in {registry.index_dir()}"
        )


def listing(root: Path | None = None) -> Listing:
    """With root (--jobs-dir): the jobs under it. Without: every job in the per-user index, and those under the
    default jobs root ($LLMCTL_JOBS_DIR or ./llmctl-jobs) that an older llmctl launched without registering them."""
    if root is not None:
        return Listing(all_records(root), [], str(root))
    by_folder: dict[str, JobRecord] = {}
    gone = []
    for e in registry.entries():
        try:
            by_folder[e.folder] = load(Path(e.folder))
        except FileNotFoundError:
            gone.append(e)
        except (OSError, ValueError, TypeError):
            continue  # a folder we may not read, or a record being rewritten: not listed this time
    for r in all_records(jobs_root()):
        by_folder.setdefault(r.folder, r)
    return Listing(sorted(by_folder.values(), key=_order), gone, f"the job index {registry.index_dir()}")


def find(job: str | None, root: Path | None = None) -> JobRecord:
    """A job by id (SLURM's, or local-<pid>), folder name or folder path; None: the latest launched. Looked up under
    root when given (--jobs-dir), else in the per-user index. The newest wins if an id was reused."""
    if job is not None:
        p = Path(job)
        if (p / RECORD).is_file():
            return load(p)
    found = listing(root)
    if job is None:
        if not found.records:
            raise InputError(f"no jobs in {found.where}", hint="launch one with `llmctl launch PLAN`")
        return found.records[-1]
    matches = [r for r in found.records if job in (r.job_id, Path(r.folder).name)]
    if matches:
        return matches[-1]
    gone = [e for e in found.gone if job in (e.job_id, Path(e.folder).name)]
    if gone:
        raise InputError(f"job {job!r}: its folder {shell.quote(gone[-1].folder)} no longer exists")
    raise InputError(f"no job {job!r} in {found.where}", hint="see `llmctl status` for the list")


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


def events(record: JobRecord) -> list[str]:
    """The non-empty lines of the job's `events` file (none when it is missing or unreadable)."""
    try:
        text = (Path(record.folder) / EVENTS).read_text(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.split("\n") if ln.strip()]


def append_event(record: JobRecord, line: str) -> None:
    """Append one line to the job's `events` (O_APPEND: one short write, so lines from two writers do not mix)."""
    with open(Path(record.folder) / EVENTS, "a") as f:
        f.write(line.rstrip("\n") + "\n")


def now_utc(precise: bool = False) -> str:
    """ISO 8601 UTC; `precise` adds milliseconds (a job's submission time: two launches in one second still sort)."""
    t = time.time()
    ms = f".{int(t * 1000) % 1000:03d}" if precise else ""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ms + "Z"


def preflight_note(record: JobRecord) -> str:
    """The last preflight line of the job's events (llmctl.launch.preflight), shortened: "ok: training on ...",
    "failed: ...", "warning: ..."; "" when the job had none."""
    lines = [ln for ln in events(record) if ln.startswith("preflight ")]
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
    """What the job folder's `events` say, read in order: "exit N" -> COMPLETED or FAILED (exit N); "requeued" ->
    REQUEUED; "cancelled" -> CANCELLED, which later "exit" lines do not change (the sbatch script still appends
    one after scancel); "cancel-requested" with nothing after it -> CANCELLING (a local run's ranks are saving their
    checkpoint). Without any: FINISHED when submitit left a result, else UNKNOWN."""
    state = "UNKNOWN"
    for line in events(record):
        word, *rest = line.split()
        if word == "requeued":
            state = "REQUEUED"
        elif word == CANCELLED:
            state = "CANCELLED"
        elif word == CANCEL_REQUESTED and state != "CANCELLED":
            state = "CANCELLING"
        elif word == "exit" and rest and state != "CANCELLED":
            state = "COMPLETED" if rest[0] == "0" else f"FAILED (exit {rest[0]})"
    if state == "UNKNOWN" and list((Path(record.folder) / "submitit").glob("*_result.pkl")):
        return "FINISHED"
    return state


def requeues(record: JobRecord) -> int:
    """How many times the job checkpointed and was requeued (its events' "requeued" lines)."""
    return sum(1 for ln in events(record) if ln.startswith("requeued "))


def slurm_job_state(slurm: str | None, folder: str, requeued: int) -> str:
    """A SLURM job's state from what SLURM says (None: it knows nothing, e.g. no accounting) and what its folder
    says (`folder_state`), in SLURM's words: a requeued job waiting again is REQUEUED (PENDING to squeue), a job
    `llmctl cancel` stopped is CANCELLED (CANCELLING while its steps still run), a failed one FAILED (exit N)."""
    if slurm is None:
        return folder
    if slurm in ACTIVE:
        if folder == "CANCELLED":
            return "CANCELLING"
        if requeued and slurm in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
            return f"REQUEUED ({slurm.lower()}, restart {requeued})"
        return f"{slurm} (restart {requeued})" if requeued else slurm
    if slurm == "CANCELLED" or folder == "CANCELLED":
        return "CANCELLED"
    if slurm == "FAILED" and folder.startswith("FAILED"):
        return folder  # with the exit code the script recorded
    return slurm


def last_checkpoint_step(record: JobRecord) -> int | None:
    """The step of the newest complete checkpoint in the job's checkpoint.dir (None: none, or not known)."""
    if not record.checkpoint_dir:
        return None
    from llmctl.engine.checkpoint import latest_checkpoint  # torch-free at import: the layout's one definition

    try:
        latest = latest_checkpoint(Path(record.checkpoint_dir))
    except OSError:
        return None
    return latest[0] if latest else None


ACTIVE = {
    "CANCELLING",
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
