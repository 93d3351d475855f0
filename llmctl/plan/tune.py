"""`llmctl tune`, the torch-free half: which setups to try, the plan each trial runs, what its metrics say, and the
report that is also the calibration file `llmctl plan --calibrate` reads.

A setup is what tuning varies in a plan, its global batch held fixed: the sharding strategy, micro-batch x gradient
accumulation, activation checkpointing and torch.compile. The planner's own model (`planner.predict`: the step
time of `planner.evaluate`, the bytes of the memory model) times and sizes every setup of the space; those that do
not fit the device are dropped. The picks are the predicted best, then for each decision in `DECISIONS` the best
setup that differs from it in that decision alone (so that each trial tests one choice the planner made), then the
next best until K. A trial runs the base plan with its setup for warm-up + N steps, logging every step, without
checkpoints, validation or loggers; its measurement is the median over the step records after warm-up (with
several rounds, the geometric mean of the rounds' medians).
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan import planner as pl
from llmctl.plan.network import network_for
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import planfile as pf
from llmctl.spec.hardware import GIB, GPUSpec, make_cluster, resolve_gpu
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import ENGINE_STRATEGIES, canonical_strategy
from llmctl.spec.precision import compute_dtype

DECISIONS = ("micro_batch", "checkpointing", "compile", "strategy")
"""The planner's decisions a trial can test, in the order the picks after the first test them."""
REFERENCE_GPU = "A100-80GB"
"""A plan without a GPU kind (a CPU run) is still ordered by the planner's model, on this GPU (where its kernel
factors were measured); those figures are not this machine's, so none is shown or written."""
KIND = "llmctl-tune"
VERSION = 1
FAIL_ENV = "LLMCTL_TUNE_FAIL_TRIALS"
"""Test hook: comma-separated trial numbers (1-based, in run order) whose plan reads a data file that does not
exist, so that the engine fails at start, through the path a crash or an out-of-memory error takes (one line in
$LLMCTL_ERROR_FILE, a non-zero exit); tuning goes on with the other trials."""
NOISE = 0.10
"""Step times on a shared machine move by this much between runs minutes apart (README, checkpointing benchmark:
up to 30% on the 2-core test VM, +-10% within one tune): a smaller measured margin is flagged as possible noise."""
DEFAULT_STEPS = 10
DEFAULT_WARMUP = 3
DEFAULT_TOP = 3


# --- setups and the space ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What a trial varies; micro_batch x grad_accum is the plan's per-rank batch."""

    strategy: str
    micro_batch: int
    grad_accum: int
    checkpointing: str
    compile: bool

    @classmethod
    def of_plan(cls, plan: pf.Plan) -> Setup:
        t = plan.training
        return cls(
            plan.parallel.sharding, t.micro_batch_size, t.grad_accum_steps, t.activation_checkpointing, t.compile
        )

    @property
    def label(self) -> str:
        """'full_shard 8x1 ckpt none', '... compiled'."""
        return (
            f"{self.strategy} {self.micro_batch}x{self.grad_accum} ckpt {self.checkpointing}"
            f"{' compiled' if self.compile else ''}"
        )

    def differs_only_in(self, other: Setup, decision: str) -> bool:
        """Whether the two differ in `decision` (micro_batch carries grad_accum with it) and in nothing else."""
        names = [d for d in DECISIONS if d != decision]
        return getattr(self, decision) != getattr(other, decision) and all(
            getattr(self, n) == getattr(other, n) for n in names
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "checkpointing": self.checkpointing,
            "compile": self.compile,
        }


@dataclass(frozen=True)
class Space:
    """The values each decision may take; the product, at the plan's per-rank batch, is the pool."""

    strategies: tuple[str, ...]
    micro_batches: tuple[int, ...]
    checkpointing: tuple[str, ...]
    compile: tuple[bool, ...]
    per_rank_batch: int

    def setups(self) -> list[Setup]:
        return [
            Setup(s, mb, self.per_rank_batch // mb, ck, comp)
            for s, mb, ck, comp in itertools.product(
                self.strategies, self.micro_batches, self.checkpointing, self.compile
            )
        ]


def space_for(
    base: Setup,
    spec: ModelSpec,
    nodes: int,
    world: int,
    strategies: Sequence[str] | None = None,
    micro_batches: Sequence[int] | None = None,
    checkpointing: Sequence[str] | None = None,
    compile_: bool | None = None,
) -> Space:
    """The space around `base`: each decision pinned to the values given, else every value the engine runs (the
    strategies for this many nodes, the divisors of the per-rank batch, the planner's checkpointing modes, compile
    on and off). Values that cannot hold the global batch are bad input (one line)."""
    per_rank = base.micro_batch * base.grad_accum
    if strategies:
        picked = []
        for s in strategies:
            c = canonical_strategy(s, ENGINE_STRATEGIES)
            if c == "hybrid_shard" and nodes < 2:
                raise InputError("--strategy hybrid_shard needs at least 2 nodes (on one node it is full_shard)")
            picked.append(c)
        strats = _unique(picked)
    elif world == 1:
        strats = (base.strategy,)  # one rank: nothing to shard or replicate, every strategy is the same run
    else:
        strats = _unique([base.strategy, *(s for s in ENGINE_STRATEGIES if s != "hybrid_shard" or nodes > 1)])
    if micro_batches:
        for mb in micro_batches:
            if mb < 1 or per_rank % mb:
                raise InputError(
                    f"--micro-batch {mb} does not divide the {per_rank} sequences per rank "
                    f"(the global batch, held fixed, over {world} ranks)",
                    hint="one of: " + ", ".join(map(str, pl.divisors(per_rank))),
                )
        mbs = _unique(micro_batches)
    else:
        mbs = tuple(pl.divisors(per_rank))
    if checkpointing:
        ckpts = _unique([ckpt_modes.parse(c) for c in checkpointing])
    else:
        ckpts = _unique([*pl.checkpointing_modes(spec), base.checkpointing])
    comps = (compile_,) if compile_ is not None else (False, True)
    return Space(strats, mbs, ckpts, comps, per_rank)


def _unique(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(values))


# --- predictions and picks -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneCandidate:
    setup: Setup
    predicted: pl.Candidate
    """The planner's figures for this setup (on REFERENCE_GPU when the plan names no GPU: order only)."""


@dataclass(frozen=True)
class Pool:
    ranked: list[TuneCandidate]
    """Every setup that fits, best predicted first."""
    dropped: list[str]
    """Setups the memory model says do not fit, one line each."""
    device: str | None
    """The GPU kind the predictions are for; None: the plan names none (CPU), the figures only order the setups."""
    request: pl.PlanRequest


def planner_kernel(attention: str, gpu: GPUSpec | None, precision: str, spec: ModelSpec) -> str:
    """The planner's name for the kernel the engine will run for the plan's `training.attention`: auto is flash-
    attention on a GPU that runs it in a half precision (where flash-attn is installed), else SDPA."""
    if attention == "auto":
        flash = gpu is not None and gpu.flash_attention and compute_dtype(precision) != "fp32"
        attention = "flash" if flash else "sdpa"
    return spec.attention_kernel(attention)


def plan_network(plan: pf.Plan) -> cm.Network | None:
    """The network the plan was priced with, as `llmctl plan` recorded it (predicted.*_busbw_gbytes_s), else None."""
    p = plan.predicted
    if p.intra_node_busbw_gbytes_s is None or (plan.hardware.nodes > 1 and p.inter_node_busbw_gbytes_s is None):
        return None
    inter = p.inter_node_busbw_gbytes_s if plan.hardware.nodes > 1 else None
    return cm.Network(p.intra_node_busbw_gbytes_s, inter, source="the plan")


def request_for_plan(
    plan: pf.Plan,
    spec: ModelSpec,
    gpu: GPUSpec | None,
    efficiency: pl.Efficiency | None = None,
    network: cm.Network | None = None,
) -> pl.PlanRequest:
    """The planner's request for the plan as it stands: its model, ranks, sequence, global batch, precision, kernel
    and loss, on `gpu` (REFERENCE_GPU when None), over `network` (default: the one the plan records it was priced
    with, else the catalog's link inside a node; several nodes without either is one line)."""
    hw, t = plan.hardware, plan.training
    device = gpu or resolve_gpu(REFERENCE_GPU)
    cluster = make_cluster(gpu=device.name, nodes=hw.nodes, gpus_per_node=hw.nproc_per_node)
    return pl.PlanRequest(
        spec=spec,
        gpu=device,
        nodes=hw.nodes,
        gpus_per_node=hw.nproc_per_node,
        network=network or plan_network(plan) or network_for(cluster),
        seq_len=t.seq_len,
        global_batch_seqs=plan.tokens_per_step // t.seq_len,
        precision=t.precision,
        attention=planner_kernel(t.attention, gpu, t.precision, spec),
        loss_chunk_tokens=t.loss_chunk_tokens,
        efficiency=efficiency or pl.Efficiency(),
    )


def make_pool(req: pl.PlanRequest, space: Space, device: str | None, first: Setup | None = None) -> Pool:
    """Time and size every setup of the space with the planner's model; drop what does not fit (on a named GPU);
    rank by predicted tokens/s. `first` (the planner's chosen setup) is put first when it is in the pool."""
    fitting, dropped = [], []
    attention = req.attention or "sdpa"
    for s in space.setups():
        c = pl.predict(
            req,
            s.strategy,
            req.nodes,
            s.micro_batch,
            s.grad_accum,
            s.checkpointing,
            attention,
            s.compile,
            chunk=req.loss_chunk_tokens or 0,
        )
        if device is not None and c.memory_per_gpu_bytes > req.gpu.memory_bytes:
            dropped.append(
                f"{s.label}: {c.memory_per_gpu_bytes / GIB:.1f} GiB per GPU predicted > "
                f"{req.gpu.memory_bytes / GIB:.1f} GiB"
            )
            continue
        fitting.append(TuneCandidate(s, c))
    ranked = sorted(fitting, key=lambda c: -c.predicted.tokens_per_s)  # stable: ties keep the space's order
    if first is not None:
        ranked.sort(key=lambda c: c.setup != first)
    return Pool(ranked, dropped, device, req)


def select(ranked: Sequence[TuneCandidate], k: int) -> list[TuneCandidate]:
    """The predicted best; then per decision (DECISIONS) the best that differs from it in that decision alone;
    then the next best not yet picked; k in all (fewer when the pool is smaller)."""
    if not ranked or k < 1:
        return []
    best = ranked[0]
    picks = [best]
    for decision in DECISIONS:
        if len(picks) >= k:
            break
        alt = next((c for c in ranked if c not in picks and c.setup.differs_only_in(best.setup, decision)), None)
        if alt is not None:
            picks.append(alt)
    for c in ranked:
        if len(picks) >= k:
            break
        if c not in picks:
            picks.append(c)
    return picks


# --- trial plans -----------------------------------------------------------------------------------------------------
def predicted_block(c: pl.Candidate, network: cm.Network | None = None) -> dict[str, Any]:
    """The plan's `predicted:` section for a candidate, as `planner.to_plan` writes it (its rounding; the bus
    bandwidths the prediction assumed, which the launch preflight compares with, when the network is given)."""
    out: dict[str, Any] = {
        "tokens_per_s": round(c.tokens_per_s, 1),
        "tokens_per_s_per_gpu": round(c.tokens_per_s_per_gpu, 1),
        "mfu": round(c.mfu, 4),
        "step_time_s": round(c.step_time_s, 4),
        "memory_per_gpu_bytes": c.memory_per_gpu_bytes,
    }
    if network is not None:
        out["intra_node_busbw_gbytes_s"] = round(network.intra_gbytes_s, 3)
        inter = network.inter_node_gbytes_s
        out["inter_node_busbw_gbytes_s"] = round(inter, 3) if c.nodes > 1 and inter is not None else None
    return out


def apply_setup(
    plan: pf.Plan, setup: Setup, predicted: pl.Candidate | None, source: str, network: cm.Network | None = None
) -> pf.Plan:
    """The plan with this setup (everything else as it was) and its prediction (none: an empty `predicted:`)."""
    data = plan.model_dump(mode="json")
    data["parallel"]["sharding"] = setup.strategy
    if setup.strategy != "hybrid_shard":
        data["parallel"]["shard_size"] = None
    data["training"].update(
        micro_batch_size=setup.micro_batch,
        grad_accum_steps=setup.grad_accum,
        activation_checkpointing=setup.checkpointing,
        compile=setup.compile,
    )
    data["predicted"] = predicted_block(predicted, network) if predicted is not None else {}
    return pf.plan_from_dict(data, source)


def trial_plan(
    base: pf.Plan,
    cand: TuneCandidate,
    number: int,
    folder: Path,
    steps: int,
    warmup: int,
    with_prediction: bool,
    fail: bool = False,
    network: cm.Network | None = None,
) -> pf.Plan:
    """What trial `number` runs: the base plan with the candidate's setup, for warmup + steps steps, every step
    logged to folder/logs/metrics.jsonl; no checkpoints (a trial must neither resume from nor overwrite the run's),
    no validation, no TensorBoard/W&B. `fail`: the FAIL_ENV hook."""
    plan = apply_setup(base, cand.setup, cand.predicted if with_prediction else None, f"trial {number}", network)
    data = plan.model_dump(mode="json")
    data["name"] = f"{base.name[:200]}-tune-{number}"
    data["training"].update(max_steps=warmup + steps, token_budget=None)
    data["checkpoint"]["dir"] = None
    data["logging"].update(dir=str(folder / "logs"), interval_steps=1, tensorboard=False, wandb=None)
    data["data"]["val"] = None
    if fail:
        data["data"] = {"kind": "text", "paths": [str(folder / f"missing-on-purpose-{FAIL_ENV}.txt")]}
    return pf.plan_from_dict(data, f"the plan of trial {number}")


def failing_trials(environ: Mapping[str, str] | None = None) -> set[int]:
    """The trial numbers FAIL_ENV names (bad entries: one line)."""
    raw = (environ if environ is not None else os.environ).get(FAIL_ENV, "")
    out = set()
    for part in filter(None, (p.strip() for p in raw.split(","))):
        if not part.isdigit():
            raise InputError(f"${FAIL_ENV}: expected trial numbers like 2 or 1,3, got {raw!r}")
        out.add(int(part))
    return out


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_kind": self.memory_kind,
            "steps": self.steps,
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
    return Measured(
        statistics.median(float(r["tokens_per_s"]) for r in steps),
        statistics.median(float(r["step_time_s"]) for r in steps),
        peak,
        kind,
        len(steps),
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
    )


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


# --- the report ------------------------------------------------------------------------------------------------------
@dataclass
class Trial:
    number: int
    candidate: TuneCandidate
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
    def setup(self) -> Setup:
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
        return max(ok, key=lambda t: t.measured.tokens_per_s) if ok else None  # type: ignore[union-attr]

    def rank_predicted(self) -> dict[int, int]:
        """Trial number -> its rank among all trials by predicted tokens/s (1: predicted fastest)."""
        order = sorted(self.trials, key=lambda t: (-t.candidate.predicted.tokens_per_s, t.number))
        return {t.number: i + 1 for i, t in enumerate(order)}

    def rank_measured(self) -> dict[int, int]:
        """Trial number -> its rank among the trials that ran by measured tokens/s (1: measured fastest)."""
        order = sorted(self.ok, key=lambda t: (-t.measured.tokens_per_s, t.number))  # type: ignore[union-attr]
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
                        **t.setup.as_dict(),
                        "nodes": self.nodes,
                        "nproc_per_node": self.nproc_per_node,
                        "attention": pred.attention,
                        "loss_chunk_tokens": pred.loss_chunk_tokens,
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


def _predicted_figures(c: pl.Candidate) -> dict[str, Any]:
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


# --- reading it back: `llmctl plan --calibrate tune.json` -------------------------------------------------------------
def is_report(data: Any) -> bool:
    return isinstance(data, dict) and data.get("kind") == KIND


def calibration(data: dict[str, Any], source: str) -> pl.Calibration:
    """The efficiency multiplier from a tune report: measured / predicted tokens/s of its best trial, times the
    calibration its predictions were made with (so the factor is relative to the uncalibrated model)."""
    if data.get("version") != VERSION:
        raise InputError(f"{source}: tune report version {data.get('version')!r} (this llmctl reads {VERSION})")
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
    return pl.Calibration(
        float(measured) / float(predicted) * float(prior),
        int(steps) if isinstance(steps, int) else 0,
        float(measured),
        float(predicted),
        f"measured / predicted tokens/s of tune trial {best} ({trial.get('label', '?')})",
    )
