"""What `llmctl tune` shows: a progress bar per trial while they run (plain lines off a terminal), then the table of
predicted vs measured figures and the files written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape

from llmctl.cli import render
from llmctl.tune.report import Measured, Report, Trial
from llmctl.tune.run import say
from llmctl.units import gib


def show(report: Report, data: dict[str, Any], json_out: bool, written: tuple[Path, Path, Path] | None) -> None:
    if json_out:
        if written:
            data = {
                **data,
                "plan_path": str(written[0]),
                "calibration_path": str(written[1]),
                "tune_dir": str(written[2]),
            }
        render.print_json(data)
        return
    c = render.console
    shown = report.device is not None
    # Step time is not a column: at the fixed global batch it is tokens per step / tokens/s (it is in the JSON).
    t = render.table(
        f"Trials: predicted{f' for {report.device}' if shown else ' (order only)'} vs measured here",
        [
            ("#", "right"),
            ("setup", "left"),
            ("tok/s\npred", "right"),
            ("tok/s\nmeas", "right"),
            ("ratio", "right"),
            ("GiB\npred", "right"),
            ("GiB\nmeas", "right"),
            ("rank\npred", "right"),
            ("rank\nmeas", "right"),
            ("status", "left"),
        ],
    )
    for i, col in enumerate(t.columns):
        col.no_wrap = i != 1  # figures stay whole; a narrow terminal wraps the setup's name
    t.columns[1].min_width = 14
    best = report.best
    for row in data["trials"]:
        p, m = row["predicted"], row["measured"]
        t.add_row(
            str(row["trial"]),
            row["label"],
            f"{p['tokens_per_s']:,.0f}" if p else "-",
            f"{m['tokens_per_s']:,.0f}" if m else "-",
            f"{row['ratio']:.3g}" if row["ratio"] is not None else "-",
            gib(p["memory_per_gpu_bytes"], 2) if p else "-",
            gib(m["peak_memory_bytes"], 2) if m and m["peak_memory_bytes"] is not None else "-",
            str(row["rank_predicted"]),
            str(row["rank_measured"] or "-"),
            row["status"],
            style="bold green" if best is not None and row["trial"] == best.number else None,
        )
    c.print(t)
    kinds = {row["measured"]["memory_kind"] for row in data["trials"] if row["measured"]}
    if "peak_rss_bytes" in kinds:
        c.print("[dim]GiB meas on a CPU: rank 0's peak resident memory (getrusage), not a device's[/dim]")
    for row in data["trials"]:
        if row["status"] != "ok":
            c.print(f"trial {row['trial']} failed: {escape(row['reason'] or '?')}", soft_wrap=True)
    verdict = data["ranking_verdict"]
    if verdict:
        c.print(f"[bold]{escape(verdict)}[/bold]", soft_wrap=True)
    elif len(report.ok) > 1:
        c.print("the planner's ranking held: the measured order is the predicted order")
    if best is None or written is None:
        return
    m = best.measured
    assert m is not None  # best is a trial that ran
    pred = best.candidate.predicted
    vs = f" (predicted {pred.tokens_per_s:,.0f}, ratio {m.tokens_per_s / pred.tokens_per_s:.3g})" if shown else ""
    plan_path, cal_path, folder = (escape(str(p)) for p in written)
    for line in (
        f"\n[bold]measured best[/bold]: trial {best.number}, {escape(best.setup.label)}: {m.tokens_per_s:,.0f} "
        f"tokens/s{vs}, {m.step_time_s:.3f} s/step",
        f"plan written to {plan_path} (run it: llmctl launch {plan_path})",
        f"calibration written to {cal_path} (llmctl plan ... --calibrate {cal_path})"
        if shown
        else f"tune report written to {cal_path} (no predictions to calibrate `llmctl plan` with: the plan names no "
        "GPU kind; tune a plan with hardware.gpu set, or pass --gpu KIND to tune)",
        f"trials in {folder}",
    ):
        c.print(line, soft_wrap=True)


class Progress:
    """A rich progress bar per trial and round on a terminal (stderr); plain lines otherwise (logs, CI, tests)."""

    def __init__(self, trials: int, total_steps: int, rounds: int) -> None:
        self.trials, self.total, self.rounds = trials, total_steps, rounds
        self.rich = render.err_console.is_terminal
        self._bar: Any = None
        self._task: Any = None
        self._seconds_before = 0.0

    def __enter__(self) -> Progress:
        if self.rich:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("steps"),
                TimeElapsedColumn(),
                console=render.err_console,
            )
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def _what(self, t: Trial, rnd: int) -> str:
        again = f" (round {rnd}/{self.rounds})" if self.rounds > 1 else ""
        return f"trial {t.number}/{self.trials}{again} {t.setup.label}"

    def start(self, t: Trial, rnd: int) -> None:
        self._seconds_before = t.seconds
        if self._bar is not None:
            self._task = self._bar.add_task(escape(self._what(t, rnd)), total=self.total)
        else:
            say(f"{self._what(t, rnd)}: running")

    def step(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=n)

    def end(self, t: Trial, rnd: int, this_round: Measured | None) -> None:
        if t.measured is not None and this_round is not None:
            m = this_round
            line = f"{self._what(t, rnd)}: {m.tokens_per_s:,.0f} tok/s, {m.step_time_s:.3f} s/step"
            if rnd > 1:
                line += f" (all rounds: {t.measured.tokens_per_s:,.0f} tok/s)"
            line += f", {t.seconds - self._seconds_before:.0f} s"
        else:
            line = f"{self._what(t, rnd)}: failed: {t.reason}"
        if self._bar is not None:
            self._bar.update(self._task, description=escape(line))
        else:
            say(line)
