"""What the trials measured, next to what was predicted: the report `llmctl tune` prints and writes (it is also the
calibration file `llmctl plan --calibrate` reads, llmctl.plan.calibrate). Torch-free."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.plan.calibrate import TUNE_REPORT_KIND as KIND
from llmctl.plan.calibrate import TUNE_REPORT_VERSION as VERSION
from llmctl.plan.timing import Candidate, Prediction
from llmctl.spec.decisions import as_json
from llmctl.spec.setup import TrainSetup
from llmctl.tune.space import REFERENCE_GPU

NOISE = 0.10
"""Step times on a shared machine move by this much between runs minutes apart (README, checkpointing benchmark:
up to 30% on the 2-core test VM, +-10% within one tune): a smaller measured margin is flagged as possible noise."""


# --- measurements ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    tokens_per_s: float
    """Median over the step records after warm-up (global, all ranks); over several rounds, the geometric mean of
    the rounds' medians (`measure_rounds`)."""
    step_time_s: float
    """Median optimizer-step time (rounds: as tokens_per_s)."""
    peak_memory_bytes: int | None
    """Largest peak after warm-up: CUDA reserved bytes, or on a CPU rank 0's peak resident set (getrusage)."""
    memory_kind: str | None
    """The metrics field it comes from: peak_mem_reserved_bytes or peak_rss_bytes."""
    steps: int
    alloc_retries: int = 0
    """Allocations the CUDA caching allocator retried after freeing its cache (the engine's alloc_retries, the
    largest count seen): a trial with any ranks below one without (each retry stalls a step; fms-fsdp issue 63)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_kind": self.memory_kind,
            "steps": self.steps,
            "alloc_retries": self.alloc_retries,
        }


def measure(records: Iterable[dict[str, Any]], warmup: int) -> Measured | None:
    """The trial's figures from its metrics.jsonl records (llmctl.engine.metrics field names): the step records
    after `warmup` steps; None when there are none."""
    steps = [
        r
        for r in records
        if r.get("event") == "step"
        and isinstance(r.get("step"), int)
        and r["step"] > warmup
        and _positive(r.get("tokens_per_s"))
        and _positive(r.get("step_time_s"))
    ]
    if not steps:
        return None
    kind, peak = None, None
    for key in ("peak_mem_reserved_bytes", "peak_rss_bytes"):
        values = [int(r[key]) for r in steps if isinstance(r.get(key), (int, float))]
        if values:
            kind, peak = key, max(values)
            break
    retries = max((int(r["alloc_retries"]) for r in steps if isinstance(r.get("alloc_retries"), int)), default=0)
    return Measured(
        statistics.median(float(r["tokens_per_s"]) for r in steps),
        statistics.median(float(r["step_time_s"]) for r in steps),
        peak,
        kind,
        len(steps),
        retries,
    )


def measure_rounds(rounds: Sequence[Iterable[dict[str, Any]]], warmup: int) -> Measured | None:
    """Several rounds of one trial: the geometric mean of each round's median tokens/s and step time (a drift in the
    machine's speed between rounds scales every trial of a round alike, and a geometric mean keeps the ratios
    between trials; a median over the pooled steps would land between two speeds), the largest peak memory, the
    steps of all rounds. None when a round has no step after warm-up."""
    each = [measure(r, warmup) for r in rounds]
    ms = [m for m in each if m is not None]
    if not ms or len(ms) < len(each):
        return None
    peaks = [m.peak_memory_bytes for m in ms if m.peak_memory_bytes is not None]
    return Measured(
        statistics.geometric_mean(m.tokens_per_s for m in ms),
        statistics.geometric_mean(m.step_time_s for m in ms),
        max(peaks) if peaks else None,
        ms[0].memory_kind,
        sum(m.steps for m in ms),
        max(m.alloc_retries for m in ms),
    )


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


# --- the report ------------------------------------------------------------------------------------------------------
def measured_order(t: Trial) -> tuple[bool, float, int]:
    """How trials that ran rank: any allocator retries last (a setup on the edge of memory: slower steps now and then,
    an out-of-memory error after a longer sequence or a fragmented allocator), then by measured tokens/s."""
    m = t.measured
    assert m is not None
    return (m.alloc_retries > 0, -m.tokens_per_s, t.number)


@dataclass
class Trial:
    number: int
    candidate: Candidate
    folder: Path
    status: str = "pending"
    """pending, ok or failed."""
    reason: str | None = None
    """Why it failed, one line."""
    measured: Measured | None = None
    """Over every round run so far (`measure_rounds`)."""
    seconds: float = 0.0
    round_records: list[list[dict[str, Any]]] = field(default_factory=list, repr=False)
    """The metrics.jsonl records of each round run (`--rounds`: the trials run one after another, then again, so
    that a drift in the machine's speed falls on all of them alike), in order."""

    @property
    def rounds(self) -> int:
        return len(self.round_records)

    @property
    def setup(self) -> TrainSetup:
        return self.candidate.setup


@dataclass
class Report:
    source: str
    model: str
    device: str | None
    """The GPU kind the predictions are for (None: no prediction shown; order from REFERENCE_GPU)."""
    nodes: int
    nproc_per_node: int
    seq_len: int
    global_batch_seqs: int
    attention: str
    loss_chunk_tokens: int
    steps: int
    warmup: int
    efficiency_calibration: float
    trials: list[Trial]
    considered: int
    dropped: list[str] = field(default_factory=list)
    rounds: int = 1
    created_utc: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def ok(self) -> list[Trial]:
        return [t for t in self.trials if t.status == "ok" and t.measured is not None]

    @property
    def best(self) -> Trial | None:
        ok = self.ok
        return min(ok, key=measured_order) if ok else None

    def rank_predicted(self) -> dict[int, int]:
        """Trial number -> its rank among all trials by predicted tokens/s (1: predicted fastest)."""
        order = sorted(self.trials, key=lambda t: (-t.candidate.predicted.tokens_per_s, t.number))
        return {t.number: i + 1 for i, t in enumerate(order)}

    def rank_measured(self) -> dict[int, int]:
        """Trial number -> its rank among the trials that ran by measured tokens/s (1: measured fastest)."""
        order = sorted(self.ok, key=measured_order)
        return {t.number: i + 1 for i, t in enumerate(order)}

    def ranking_verdict(self) -> str | None:
        """One line when the measured order of the trials that ran differs from the predicted one, else None."""
        ok = self.ok
        if len(ok) < 2:
            return None
        rp = self.rank_predicted()
        by_pred = [t.number for t in sorted(ok, key=lambda t: rp[t.number])]
        by_meas = [t.number for t in sorted(ok, key=lambda t: self.rank_measured()[t.number])]
        if by_pred == by_meas:
            return None
        orders = f"measured order {_seq(by_meas)}, predicted {_seq(by_pred)}"
        pred_best, meas_best = self._trial(by_pred[0]), self._trial(by_meas[0])
        if by_pred[0] != by_meas[0]:
            ratio = meas_best.measured.tokens_per_s / pred_best.measured.tokens_per_s  # type: ignore[union-attr]
            return (
                f"the planner's ranking was wrong: it predicted trial {pred_best.number} ({pred_best.setup.label}) "
                f"fastest, but trial {meas_best.number} ({meas_best.setup.label}) measured {ratio:.2f}x its "
                f"tokens/s ({orders}{self._noise(pred_best, meas_best, ratio)})"
            )
        i = next(i for i, (p, m) in enumerate(zip(by_pred, by_meas, strict=True)) if p != m)
        a, b = self._trial(by_pred[i]), self._trial(by_meas[i])  # b measured ahead of a, predicted behind it
        ratio = b.measured.tokens_per_s / a.measured.tokens_per_s  # type: ignore[union-attr]
        return f"the planner's ranking was wrong below the top: {orders}{self._noise(a, b, ratio)}"

    def _noise(self, pred_best: Trial, meas_best: Trial, ratio: float) -> str:
        """Why the verdict may be noise: with several rounds, the two trials' order was not the same in each; with
        one, a margin under NOISE."""
        if pred_best.rounds > 1 and pred_best.rounds == meas_best.rounds:
            pairs = zip(pred_best.round_records, meas_best.round_records, strict=True)
            per_round = [(measure(a, self.warmup), measure(b, self.warmup)) for a, b in pairs]
            ratios = [b.tokens_per_s / a.tokens_per_s for a, b in per_round if a is not None and b is not None]
            if ratios and min(ratios) < 1:
                shown = ", ".join(f"{r:.2f}x" for r in ratios)
                return f"; but not in every round ({shown}): it may be noise, more --rounds tell"
            return ""
        return f"; a margin under {NOISE:.0%} may be noise: more --steps or --rounds tell" if ratio < 1 + NOISE else ""

    def header(self, pool_size: int, folder: Path) -> str:
        """The lines said before the trials run: what is tried, on what, and where the trials go."""
        pred = (
            f"predictions for {self.device}"
            if self.device
            else f"no predictions (the plan names no GPU kind; order from the planner's model on {REFERENCE_GPU})"
        )
        dropped = f", {len(self.dropped)} do not fit" if self.dropped else ""
        return (
            f"tune {self.source}: {len(self.trials)} of {pool_size} setups{dropped}; global batch "
            f"{self.global_batch_seqs} x {self.seq_len} tokens on {self.nodes} x {self.nproc_per_node} ranks; "
            f"{self.warmup} warm-up + {self.steps} measured steps each{f', {self.rounds} rounds' if self.rounds > 1 else ''}; "
            f"{pred}\ntrials in {folder}"
        )

    def _trial(self, number: int) -> Trial:
        return next(t for t in self.trials if t.number == number)

    def as_dict(self) -> dict[str, Any]:
        """The calibration file (and `--json`): per trial the candidate, predicted and measured figures."""
        rp, rm = self.rank_predicted(), self.rank_measured()
        best = self.best
        trials = []
        for t in self.trials:
            pred = t.candidate.predicted
            shown = self.device is not None
            ratio = (
                t.measured.tokens_per_s / pred.tokens_per_s
                if shown and t.measured is not None and pred.tokens_per_s > 0
                else None
            )
            trials.append(
                {
                    "trial": t.number,
                    "label": t.setup.label,
                    "candidate": {
                        **as_json(t.setup),
                        "nodes": self.nodes,
                        "nproc_per_node": self.nproc_per_node,
                        "attention": self.attention,
                        "loss_chunk_tokens": self.loss_chunk_tokens,
                    },
                    "predicted": _predicted_figures(pred) if shown else None,
                    "measured": t.measured.as_dict() if t.measured is not None else None,
                    "ratio": ratio,
                    "rank_predicted": rp[t.number],
                    "rank_measured": rm.get(t.number),
                    "status": t.status,
                    "reason": t.reason,
                    "seconds": round(t.seconds, 2),
                    "rounds": t.rounds,
                    "folder": str(t.folder),
                }
            )
        return {
            "kind": KIND,
            "version": VERSION,
            "created_utc": self.created_utc,
            "source": self.source,
            "model": self.model,
            "predicted_for": self.device,
            "order_from": self.device or REFERENCE_GPU,
            "efficiency_calibration": self.efficiency_calibration,
            "nodes": self.nodes,
            "nproc_per_node": self.nproc_per_node,
            "seq_len": self.seq_len,
            "global_batch_seqs": self.global_batch_seqs,
            "steps": self.steps,
            "warmup": self.warmup,
            "rounds": self.rounds,
            "attention": self.attention,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "considered": self.considered,
            "dropped": self.dropped[:50],
            "best_trial": best.number if best else None,
            "ranking_agrees": self.ranking_verdict() is None,
            "ranking_verdict": self.ranking_verdict(),
            "trials": trials,
        }


def _predicted_figures(c: Prediction) -> dict[str, Any]:
    return {
        "tokens_per_s": c.tokens_per_s,
        "tokens_per_s_per_gpu": c.tokens_per_s_per_gpu,
        "mfu": c.mfu,
        "step_time_s": c.step_time_s,
        "compute_s": c.compute_s,
        "comm_exposed_s": c.comm_exposed_s,
        "memory_per_gpu_bytes": c.memory_per_gpu_bytes,
    }


def _seq(numbers: Sequence[int]) -> str:
    return ", ".join(map(str, numbers))
