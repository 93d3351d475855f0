"""`llmctl tune --slurm`: the trials in one SLURM allocation. Torch-free (torch runs only in the trials' ranks).

Two halves share a trial folder (which, like a launch's job folder, must be on a file system the nodes share):
- In the job (templates/tune.sbatch.j2 -> `python -m llmctl.tune.job FOLDER`, `main`): reads `tune-job.json`,
  runs each trial as an srun step of torchrun on every node of the allocation, one after another (`--rounds`:
  all of them again), with the step `llmctl launch --slurm` uses (`llmctl.launch.slurm.NODE_STEP_SCRIPT`), and
  records each round's outcome in `trials.json` as it ends. A requeued job skips what trials.json already holds.
- On the submitting host (`follow`): waits for the job, shows each trial's progress from trials.json and the
  trial's metrics.jsonl, and fills in the trials, so that `llmctl tune` reports and writes the plan exactly as after
  local trials.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import InputError, RuntimeFailure, one_line
from llmctl.errors import report as report_error
from llmctl.fileio import write_atomic
from llmctl.tune import run as tune_trials
from llmctl.tune.report import Trial, measure, measure_rounds

JOB_FILE = "tune-job.json"
RESULTS_FILE = "trials.json"
SCRIPT = "tune.sbatch"
POLL_S = 2.0
"""How often the submitting side asks SLURM for the job's state and reads trials.json."""
UNKNOWN_POLLS = 15
"""Polls in a row with no answer from squeue, sacct and scontrol (a busy or restarting slurmctld) before the job is
taken to have ended: one unanswered poll must not fail trials that are still running."""


@dataclass(frozen=True)
class TrialSpec:
    number: int
    label: str
    plan: str
    folder: str


@dataclass(frozen=True)
class JobSpec:
    """What the job runs: written by `llmctl tune --slurm` before it submits, read by the job."""

    nodes: int
    nproc_per_node: int
    warmup: int
    steps: int
    rounds: int
    timeout_s: float
    trials: tuple[TrialSpec, ...]

    def save(self, folder: Path) -> None:
        write_atomic(folder / JOB_FILE, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, folder: Path) -> JobSpec:
        path = folder / JOB_FILE
        try:
            data = json.loads(path.read_text())
            return cls(**{**data, "trials": tuple(TrialSpec(**t) for t in data["trials"])})
        except FileNotFoundError:
            raise InputError(f"{path} not found: not a folder `llmctl tune --slurm` wrote") from None
        except (ValueError, TypeError, KeyError) as e:
            raise InputError(f"{path}: not a tune job file ({one_line(str(e))})") from None


# --- trials.json: what the job has done so far ------------------------------------------------------------------------
def read_results(folder: Path) -> dict[str, Any]:
    """{"state": "running"|"done", "current": {"trial": N, "round": R} or None, "trials": {"N": {"status",
    "reason", "seconds", "round_records"}}}; an empty record before the job has written one."""
    try:
        data = json.loads((folder / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return {"state": "pending", "current": None, "trials": {}}
    return data if isinstance(data, dict) and isinstance(data.get("trials"), dict) else {"trials": {}}


def _write_results(folder: Path, state: str, current: tuple[int, int] | None, trials: list[Trial]) -> None:
    data = {
        "state": state,
        "current": {"trial": current[0], "round": current[1]} if current else None,
        "trials": {
            str(t.number): {
                "status": t.status,
                "reason": t.reason,
                "seconds": round(t.seconds, 3),
                "round_records": t.round_records,
            }
            for t in trials
            if t.rounds or t.status != "pending"
        },
    }
    write_atomic(folder / RESULTS_FILE, json.dumps(data) + "\n")


def restore(trial: Trial, record: dict[str, Any], warmup: int) -> None:
    """A trial's state as the job recorded it (its measurement recomputed from the records, as `run_trial` does)."""
    trial.round_records = [list(r) for r in record.get("round_records") or []]
    trial.seconds = float(record.get("seconds") or 0.0)
    trial.status = record.get("status") or "pending"
    trial.reason = record.get("reason")
    trial.measured = measure_rounds(trial.round_records, warmup) if trial.status == "ok" else None


# --- in the job ---------------------------------------------------------------------------------------------------------
def _say(line: str) -> None:
    print(f"llmctl: tune: {one_line(line)}", file=sys.stderr, flush=True)


def run(folder: Path, env: dict[str, str] | None = None) -> int:
    """Run every trial round not yet recorded, one after another, on the allocation's nodes."""
    from llmctl.launch import jobs, slurm

    env = dict(os.environ) if env is None else env
    spec = JobSpec.load(folder)
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "LLMCTL_RDZV_PORT"):
        if not env.get(k):
            raise InputError(f"not inside an llmctl tune job ({k} unset)", hint="llmctl tune --slurm submits it")
    nodes = jobs.hostnames(env["SLURM_JOB_NODELIST"])
    if len(nodes) < spec.nodes:
        raise RuntimeFailure(
            f"the allocation has {len(nodes)} node(s) ({','.join(nodes)}); the trials need {spec.nodes}"
        )
    nodes = nodes[: spec.nodes]
    addr = jobs.node_addr(nodes[0])
    if addr is None:
        raise RuntimeFailure(f"scontrol knows no address for node {nodes[0]}")
    trials = [Trial(s.number, None, Path(s.folder)) for s in spec.trials]  # type: ignore[arg-type]
    done = read_results(folder)["trials"]
    for t in trials:
        if str(t.number) in done:
            restore(t, done[str(t.number)], spec.warmup)
    labels = {s.number: s.label for s in spec.trials}
    plans = {s.number: s.plan for s in spec.trials}
    base_port = int(env["LLMCTL_RDZV_PORT"])
    _say(f"{len(trials)} trial(s) x {spec.rounds} round(s) on {','.join(nodes)} ({spec.nproc_per_node} rank(s) each)")
    run_number = 0
    for rnd in range(1, spec.rounds + 1):
        for t in trials:
            run_number += 1
            if t.status == "failed" or t.rounds >= rnd:
                continue  # failed before (not retried), or recorded by an earlier run of this job
            _write_results(folder, "running", (t.number, rnd), trials)
            what = f"trial {t.number}/{len(trials)}{f' round {rnd}' if spec.rounds > 1 else ''} ({labels[t.number]})"
            _say(f"{what}: running")
            step_env = {
                **env,
                "LLMCTL_PLAN": plans[t.number],
                "LLMCTL_NNODES": str(spec.nodes),
                "LLMCTL_NPROC_PER_NODE": str(spec.nproc_per_node),
                "LLMCTL_RDZV_NODE": nodes[0],
                "LLMCTL_RDZV_ADDR": addr,
                # A port of its own per run: the last trial's rendezvous port may still be in TIME_WAIT.
                "LLMCTL_RDZV_PORT": str(base_port + run_number),
            }
            m = tune_trials.run_trial(
                t,
                Path(plans[t.number]),
                spec.nproc_per_node,
                spec.warmup,
                spec.warmup + spec.steps,
                spec.timeout_s,
                argv=slurm.node_step_argv(nodes),
                env=step_env,
            )
            if m is not None:
                _say(f"{what}: {m.tokens_per_s:,.0f} tok/s, {m.step_time_s:.3f} s/step")
            else:
                _say(f"{what}: failed: {t.reason}")
            _write_results(folder, "running", None, trials)
    _write_results(folder, "done", None, trials)
    _say(
        f"done: {sum(t.status == 'ok' for t in trials)} of {len(trials)} trial(s) ok; results in {folder / RESULTS_FILE}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(args) != 1:
            raise InputError("usage: python -m llmctl.tune.job FOLDER (the folder `llmctl tune --slurm` wrote)")
        return run(Path(args[0]))
    except Exception as e:  # one line in the job log; the submitting side reports the trials it never got
        return report_error(e)


# --- on the submitting host ---------------------------------------------------------------------------------------------
def follow(
    job_id: str,
    folder: Path,
    trials: list[Trial],
    rounds: int,
    warmup: int,
    progress: Any,
    poll_s: float = POLL_S,
) -> str:
    """Until the job has ended: its state changes as lines, each trial's progress (`progress`, a
    llmctl.cli.tune.Progress), and the trials filled in from trials.json. Returns the job's last state. Trials the job
    never finished are marked failed, naming the job's state and log."""
    from llmctl.launch import jobs

    started: set[tuple[int, int]] = set()
    ended: set[tuple[int, int]] = set()
    order = [(t, rnd) for rnd in range(1, rounds + 1) for t in trials]
    tail: tune_trials.Tail | None = None
    shown_state, state, unknown = None, "PENDING", 0
    while True:
        state = jobs.slurm_state(job_id) or "UNKNOWN"
        unknown = unknown + 1 if state == "UNKNOWN" else 0
        if state != shown_state and state not in ("RUNNING", "COMPLETING", "COMPLETED"):
            tune_trials.say(f"job {job_id}: {state}")
        shown_state = state
        results = read_results(folder)
        cur = results.get("current") or {}
        for t, rnd in order:
            key = (t.number, rnd)
            rec = results["trials"].get(str(t.number))
            recorded = rec is not None and (len(rec.get("round_records") or []) >= rnd or rec.get("status") == "failed")
            if key in ended or t.status == "failed":
                continue
            if key not in started and (recorded or (cur.get("trial"), cur.get("round")) == key):
                started.add(key)
                progress.start(t, rnd)
                tail = tune_trials.Tail(t.folder / "logs" / "metrics.jsonl", from_start=rnd == 1)
            if recorded:
                assert rec is not None
                restore(t, rec, warmup)
                this_round = measure(t.round_records[rnd - 1], warmup) if t.rounds >= rnd else None
                progress.end(t, rnd, this_round if t.status == "ok" else None)
                ended.add(key)
            elif key in started and tail is not None:
                progress.step(tail.last_step())
        if state not in jobs.ACTIVE and (state != "UNKNOWN" or unknown >= UNKNOWN_POLLS):
            break
        time.sleep(poll_s)
    log = folder / f"slurm-{job_id}.out"
    for t in trials:
        if t.status == "pending" or (t.status == "ok" and t.rounds < rounds):
            t.status, t.measured = "failed", None
            t.reason = f"the tune job ended ({state}) before this trial ran to its end (see {log})"
    return state


if __name__ == "__main__":
    sys.exit(main())
