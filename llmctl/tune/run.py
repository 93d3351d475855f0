"""The trials of `llmctl tune`: each runs with the command `llmctl launch` runs locally
(`llmctl.launch.local.torchrun_argv`: torchrun --standalone ... -m llmctl.engine PLAN), its output in the trial's
folder rather than the terminal, in a session of its own so that a timeout or Ctrl-C stops all of it; a progress
display follows the engine's metrics.jsonl. Torch-free: torch runs only inside the trials' ranks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from llmctl.childerrors import ChildErrors
from llmctl.errors import RuntimeFailure
from llmctl.tune.report import Measured, Trial, measure, measure_rounds

STOP_GRACE_S = 20.0
"""After SIGTERM, how long a trial's torchrun gets to stop its ranks before SIGKILL."""
POLL_S = 0.5
"""How often the progress display reads the trial's metrics (and the timeout is checked)."""


def say(text: str) -> None:
    typer.echo(text, err=True)


# --- running one trial -------------------------------------------------------------------------------------------------
def run_trial(
    trial: Trial,
    plan_path: Path,
    nproc: int,
    warmup: int,
    total_steps: int,
    timeout_s: float,
    on_step: Callable[[int], None] = lambda step: None,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Measured | None:
    """Run one round of a trial to its end (or its timeout): add its records to the trial's, set its status, reason
    and measurement (over every round so far), and return this round's measurement. Its output is appended to
    trial.folder/output.log, the engine's one-line failures go to trial.folder/errors-ROUND.jsonl
    ($LLMCTL_ERROR_FILE), its metrics to trial.folder/logs/metrics.jsonl (appended by the engine).

    `argv`: the command (default: the local torchrun `llmctl launch` runs; tune's SLURM job passes an srun step),
    run with `env` (default: this process's environment)."""
    from llmctl.launch import local, shell

    folder = trial.folder
    if argv is None:
        argv = local.torchrun_argv(plan_path, nproc)
    (folder / "command").write_text(shell.join(argv) + "\n")
    n = trial.rounds + 1
    errors = ChildErrors(folder / f"errors-{n}.jsonl")
    env = {**errors.env(env), "PYTHONUNBUFFERED": "1"}
    metrics = Tail(folder / "logs" / "metrics.jsonl")  # the engine appends: this round's lines only
    started = time.monotonic()
    timed_out = False
    with open(folder / "output.log", "ab") as log:
        log.write(f"llmctl tune: round {n}: {shell.join(argv)}\n".encode())
        log.flush()
        try:
            # A session of its own: on Ctrl-C or a timeout the whole trial (torchrun and its ranks) is stopped here.
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        except OSError as e:
            raise RuntimeFailure(f"could not start {argv[0]}: {e.strerror}", hint="is torch installed?") from None
        try:
            while True:
                try:
                    rc = proc.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    on_step(metrics.last_step())
                    if time.monotonic() - started > timeout_s:
                        timed_out = True
                        rc = _stop(proc)
                        break
        except BaseException:
            _stop(proc)
            raise
    on_step(metrics.last_step())
    trial.seconds += time.monotonic() - started
    mine = metrics.records()
    trial.round_records.append(mine)
    if timed_out:
        reason = f"timed out after {timeout_s:g} s (at step {metrics.last_step()} of {total_steps})"
    elif rc != 0:
        reason = _failure(rc, folder, errors)
    elif (this_round := measure(mine, warmup)) is None:
        reason = f"no step records after the {warmup} warm-up steps (see {folder / 'logs' / 'metrics.jsonl'})"
    else:
        reason = None
    if reason and trial.rounds > 1:
        reason = f"round {trial.rounds}: {reason}"
    trial.status = "failed" if reason else "ok"
    trial.reason = reason
    trial.measured = None if reason else measure_rounds(trial.round_records, warmup)
    return None if reason else this_round


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the trial's process group (torchrun passes it to the ranks), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(proc.pid, sig)
        try:
            return proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


_ERROR_LINE = re.compile(r"^(llmctl: error: .*|[A-Za-z_.]*(Error|Exception): .*)$")


def _failure(rc: int, folder: Path, errors: ChildErrors) -> str:
    """One line: what the engine reported (its error file: bad input, a runtime failure, out of memory), else the
    last error line of the output, else the exit code or signal."""
    r = errors.first()
    if r is not None:
        where = f"rank {r.rank}: " if r.rank else ""
        return f"{'out of memory' if r.kind == 'OutOfMemoryError' else 'exit ' + str(rc)}: {where}{r.message}"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name}"
    text = (folder / "output.log").read_text(errors="replace") if (folder / "output.log").exists() else ""
    lines = [ln.strip() for ln in text.splitlines() if _ERROR_LINE.match(ln.strip())]
    return f"exit {rc}: {lines[-1][:300]}" if lines else f"exit {rc} (see {folder / 'output.log'})"


class Tail:
    """The records of a growing metrics.jsonl, read incrementally (a line being written is left for next time)."""

    def __init__(self, path: Path, from_start: bool = False) -> None:
        self.path = path
        # What earlier rounds wrote is theirs (`from_start`: the first round, already running).
        self._offset = path.stat().st_size if path.is_file() and not from_start else 0
        self._records: list[dict[str, Any]] = []
        self._step = 0

    def _read(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self._records.append(rec)
                if rec.get("event") == "step" and isinstance(rec.get("step"), int):
                    self._step = rec["step"]

    def last_step(self) -> int:
        self._read()
        return self._step

    def records(self) -> list[dict[str, Any]]:
        self._read()
        return self._records
