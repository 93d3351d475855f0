"""Calibration: the factor that scales the planner's compute efficiency to what a run measured, from an engine run's
metrics.jsonl or the file `llmctl tune` writes (torch-free)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import InputError, SpecError
from llmctl.fileio import read_input

TUNE_REPORT_KIND = "llmctl-tune"
"""The `kind` of the report `llmctl tune` writes (llmctl.tune.report), which --calibrate also reads."""
TUNE_REPORT_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    factor: float
    """Multiplies every compute efficiency."""
    steps: int
    measured_tokens_per_s: float
    predicted_tokens_per_s: float | None
    method: str


def calibrate(records: list[dict[str, Any]], source: str = "metrics") -> Calibration:
    """Fit the efficiency multiplier to an engine run's step records (llmctl.engine.metrics field names).

    With the plan's predictions in the records (tokens_per_s_predicted, written by the engine next to each
    measurement), factor = median measured / median predicted tokens/s: exact when communication is hidden, an
    approximation when it is exposed (one run cannot separate compute from communication). The first step is left
    out (warm-up, compile). Without predictions, MFU-free records cannot be fitted: InputError.
    """
    steps = [r for r in records if r.get("event") == "step" and isinstance(r.get("tokens_per_s"), (int, float))]
    if len(steps) > 1:
        steps = steps[1:]
    if not steps:
        raise InputError(
            f"{source}: no step records with tokens_per_s", hint="pass the metrics.jsonl an engine run wrote"
        )
    measured = statistics.median(float(r["tokens_per_s"]) for r in steps)
    preds = [
        float(r["tokens_per_s_predicted"])
        for r in steps
        if isinstance(r.get("tokens_per_s_predicted"), (int, float)) and r["tokens_per_s_predicted"] > 0
    ]
    if preds:
        predicted = statistics.median(preds)
        return Calibration(measured / predicted, len(steps), measured, predicted, "measured / predicted tokens/s")
    raise InputError(
        f"{source}: the step records carry no tokens_per_s_predicted",
        hint="calibrate with a run of a plan written by `llmctl plan` (it records the predictions)",
    )


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A last line without its newline that is not JSON is the line a run killed
    mid-write (or still writing) left: skipped after whole lines, not a reason to refuse the file; a bad line
    anywhere else is."""
    p = Path(path)
    text = read_input(p, "metrics file")
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if 1 < i == len(lines) and not text.endswith("\n"):
                break  # after whole lines only: a file of one bad line is no metrics file
            raise SpecError(f"{p} line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise SpecError(f"{p} line {i}: expected a JSON object per line")
        out.append(rec)
    return out


def read_calibration(path: str) -> Calibration:
    """--calibrate: an engine run's metrics.jsonl, or the calibration file `llmctl tune` writes (its best trial)."""
    try:
        data = json.loads(read_input(Path(path), "metrics or tune file"))
    except (json.JSONDecodeError, RecursionError):
        data = None  # JSON lines (a metrics file): read line by line below
    if is_tune_report(data):
        return from_tune_report(data, source=path)
    return calibrate(read_metrics(path), source=path)


def is_tune_report(data: Any) -> bool:
    return isinstance(data, dict) and data.get("kind") == TUNE_REPORT_KIND


def from_tune_report(data: dict[str, Any], source: str) -> Calibration:
    """The efficiency multiplier from a tune report: measured / predicted tokens/s of its best trial, times the
    calibration its predictions were made with (so the factor is relative to the uncalibrated model)."""
    if data.get("version") != TUNE_REPORT_VERSION:
        raise InputError(
            f"{source}: tune report version {data.get('version')!r} (this llmctl reads {TUNE_REPORT_VERSION})"
        )
    best = data.get("best_trial")
    trials = data.get("trials")
    trial = next((t for t in trials if isinstance(t, dict) and t.get("trial") == best), None) if trials else None
    if trial is None:
        raise InputError(f"{source}: no trial ran to the end, nothing to calibrate with")
    measured = (trial.get("measured") or {}).get("tokens_per_s")
    predicted = (trial.get("predicted") or {}).get("tokens_per_s")
    if not _positive(predicted):
        raise InputError(
            f"{source}: trial {best} has no prediction (the plan named no GPU kind)",
            hint="tune a plan with hardware.gpu set (or pass --gpu KIND to tune)",
        )
    if not _positive(measured):
        raise InputError(f"{source}: trial {best} has no measured tokens/s")
    prior = data.get("efficiency_calibration", 1.0)
    if not _positive(prior):
        raise InputError(f"{source}: efficiency_calibration must be a positive number, got {prior!r}")
    steps = (trial.get("measured") or {}).get("steps")
    return Calibration(
        float(measured) / float(predicted) * float(prior),
        int(steps) if isinstance(steps, int) else 0,
        float(measured),
        float(predicted),
        f"measured / predicted tokens/s of tune trial {best} ({trial.get('label', '?')})",
    )


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
