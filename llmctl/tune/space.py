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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from llmctl.errors import InputError, RuleError
from llmctl.plan import comm as cm
from llmctl.plan.network import network_for
from llmctl.plan.request import Efficiency, PlanRequest
from llmctl.plan.search import divisors
from llmctl.plan.space import checkpointing_modes
from llmctl.plan.timing import Candidate, predict
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import planfile as pf
from llmctl.spec.decisions import as_json
from llmctl.spec.hardware import GPUSpec, make_cluster, resolve_gpu
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import ENGINE_STRATEGIES, canonical_strategy
from llmctl.spec.pipeline import max_stages
from llmctl.spec.setup import TrainSetup
from llmctl.units import GIB

DECISIONS = ("micro_batch", "checkpointing", "compile", "strategy", "pipeline")
"""The planner's decisions a trial can test, in the order the picks after the first test them (pipeline: pp, its
schedule and stages per rank together)."""
REFERENCE_GPU = "A100-80GB"
"""A plan without a GPU kind (a CPU run) is still ordered by the planner's model, on this GPU (where its kernel
factors were measured); those figures are not this machine's, so none is shown or written."""
DEFAULT_STEPS = 10
DEFAULT_WARMUP = 3
DEFAULT_TOP = 3


# --- setups and the space ------------------------------------------------------------------------------------------
def differs_only_in(a: TrainSetup, b: TrainSetup, decision: str) -> bool:
    """Whether the two setups differ in `decision` (micro_batch carries grad_accum with it) and in nothing else."""
    da, db = as_json(a), as_json(b)
    da["pipeline"], db["pipeline"] = pipeline_of(a), pipeline_of(b)
    others = [d for d in DECISIONS if d != decision]
    return da[decision] != db[decision] and all(da[n] == db[n] for n in others)


Pipeline = tuple[int, str, "int | None"]
"""(pp, schedule, stages per rank) a trial runs."""


def pipeline_of(s: TrainSetup) -> Pipeline:
    """The setup's pipeline: (1, '1f1b', None) without one."""
    return (s.pp, str(s.pp_schedule), s.pp_virtual_stages) if s.pp > 1 else (1, "1f1b", None)


def with_pipeline(b: TrainSetup, pipe: Pipeline) -> TrainSetup:
    """`b` on pipeline `pipe`, at the same global batch (the data-parallel ranks change with pp: the per-rank batch
    follows them, at its accumulation as one micro-batch each until the space sets the micro-batch)."""
    pp, sched, v = pipe
    if pipeline_of(b) == pipe:
        return b
    tokens = b.tokens_per_step
    flat = replace(b, pp=1, pp_schedule="1f1b", pp_virtual_stages=None, pp_microbatches=None, micro_batch_size=1)
    dp = flat.dims.dp // pp  # the data-parallel ranks at pp 1, split into pp stages
    per_rank = tokens // b.seq_len // dp
    return replace(flat, pp=pp, pp_schedule=sched, pp_virtual_stages=v, grad_accum_steps=per_rank)


def schedule_variants(base: TrainSetup, spec: ModelSpec) -> tuple[Pipeline, ...]:
    """A plan's pipeline and the other schedules at its pp that the model's layers split into (1f1b, interleaved
    1F1B at 2 stages a rank, zbv); () without a pipeline."""
    if base.pp == 1:
        return ()
    most = max_stages(spec.num_layers)
    pipes = [("1f1b", None, 1), ("interleaved-1f1b", 2, 2), ("zbv", None, 2)]
    return _unique((pipeline_of(base), *((base.pp, s, v) for s, v, k in pipes if base.pp * k <= most)))


def plan_pipelines(variants: Sequence[Candidate], most: int = 4) -> tuple[Pipeline, ...]:
    """The pipelines of the planner's best setups (its ranked variants), best first, `most` of them; () when none of
    them has pp > 1 (the trials then keep the chosen layout)."""
    pipes = _unique(pipeline_of(c.setup) for c in variants)
    if all(p[0] == 1 for p in pipes):
        return ()
    return pipes[:most]


@dataclass(frozen=True)
class Space:
    """The values each decision may take; the product, at the plan's per-rank batch, is the pool."""

    base: TrainSetup
    """Everything the decisions leave as it is (precision, kernel, loss, layout), and the per-rank batch."""
    strategies: tuple[str, ...]
    micro_batches: tuple[int, ...]
    checkpointing: tuple[str, ...]
    compile: tuple[bool, ...]
    pipelines: tuple[Pipeline, ...] = ()
    """The pipelines to try (pp, schedule, stages per rank); () : the base's alone."""

    @property
    def per_rank_batch(self) -> int:
        return self.base.per_rank_batch

    def setups(self) -> list[TrainSetup]:
        out = []
        for pipe in self.pipelines or (pipeline_of(self.base),):
            b = with_pipeline(self.base, pipe)
            per_rank = b.per_rank_batch
            for s, mb, ck, comp in itertools.product(
                self.strategies, self.micro_batches, self.checkpointing, self.compile
            ):
                accum = per_rank // mb if per_rank % mb == 0 else 0
                if not accum or (b.pp_microbatches and accum % b.pp_microbatches):
                    continue  # the micro-batch does not divide this pipeline's per-rank batch
                try:
                    setup = replace(
                        b,
                        strategy=s,
                        shard_size=b.shard_size if s == "hybrid_shard" else None,
                        micro_batch_size=mb,
                        grad_accum_steps=accum,
                        checkpointing=ck,
                        compile=comp,
                        async_tp=b.async_tp and comp,  # async TP is an inductor pass: off with compile off
                    )
                except (RuleError, InputError):
                    # a layout this pipeline does not split into (hybrid_shard's groups under pp), or one whose
                    # shard ranks the plan's expert parallelism cannot borrow from (no_shard has none at ep > 1)
                    continue
                out.append(setup)
        return out


def space_for(
    base: TrainSetup,
    spec: ModelSpec,
    strategies: Sequence[str] | None = None,
    micro_batches: Sequence[int] | None = None,
    checkpointing: Sequence[str] | None = None,
    compile_: bool | None = None,
    pipelines: Sequence[Pipeline] | None = None,
) -> Space:
    """The space around `base`: each decision pinned to the values given, else every value the engine runs (the
    strategies for this many nodes, the divisors of the per-rank batch, the planner's checkpointing modes, compile
    on and off). Values that cannot hold the global batch are bad input (one line)."""
    nodes, world = base.nodes, base.world_size
    per_rank = base.per_rank_batch
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
                    hint="one of: " + ", ".join(map(str, divisors(per_rank))),
                )
        mbs = _unique(micro_batches)
    else:
        mbs = tuple(divisors(per_rank))
    if checkpointing:
        ckpts = _unique([ckpt_modes.parse(c) for c in checkpointing])
    else:
        ckpts = _unique([*checkpointing_modes(spec), base.checkpointing])
    comps = (compile_,) if compile_ is not None else (False, True)
    pipes = _unique([pipeline_of(base), *pipelines]) if pipelines else ()
    if pipes and not micro_batches:  # every pipeline's own divisors (its per-rank batch follows its dp)
        mbs = _unique([*mbs, *(d for p in pipes for d in divisors(with_pipeline(base, p).per_rank_batch))])
    return Space(base, strats, mbs, ckpts, comps, pipes)


def _unique(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(values))


# --- predictions and picks -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pool:
    ranked: list[Candidate]
    """The planner's figures for each setup (on REFERENCE_GPU when the plan names no GPU: order only)."""
    """Every setup that fits, best predicted first."""
    dropped: list[str]
    """Setups the memory model says do not fit, one line each."""
    device: str | None
    """The GPU kind the predictions are for; None: the plan names none (CPU), the figures only order the setups."""
    request: PlanRequest


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
    efficiency: Efficiency | None = None,
    network: cm.Network | None = None,
) -> PlanRequest:
    """The planner's request for the plan as it stands: its model, ranks, sequence, global batch, precision, kernel
    and loss, on `gpu` (REFERENCE_GPU when None), over `network` (default: the one the plan records it was priced
    with, else the catalog's link inside a node; several nodes without either is one line)."""
    hw, setup = plan.hardware, plan.setup
    device = gpu or resolve_gpu(REFERENCE_GPU)
    cluster = make_cluster(gpu=device.name, nodes=hw.nodes, gpus_per_node=hw.nproc_per_node)
    return PlanRequest(
        spec=spec,
        gpu=device,
        nodes=hw.nodes,
        gpus_per_node=hw.nproc_per_node,
        network=network or plan_network(plan) or network_for(cluster),
        seq_len=setup.seq_len,
        global_batch_seqs=setup.tokens_per_step // setup.seq_len,
        precision=setup.precision,
        # Ring attention (cp > 1) runs on SDPA whatever `auto` would pick without it (TrainSetup.kernel).
        pins={"attention": setup.kernel(gpu, spec), "loss_chunk_tokens": setup.loss_chunk_tokens},
        efficiency=efficiency or Efficiency(),
    )


def make_pool(req: PlanRequest, space: Space, device: str | None, first: TrainSetup | None = None) -> Pool:
    """Time and size every setup of the space with the planner's model (on the request's kernel and loss); drop what
    does not fit (on a named GPU); rank by predicted tokens/s. `first` (the planner's chosen setup) is put first when
    it is in the pool. Each candidate keeps its setup as the plan spells it (`attention: auto` stays auto)."""
    fitting, dropped = [], []
    attention = req.pin("attention") or "sdpa"
    for s in space.setups():
        chunk = 0 if s.dims.tp_enabled else req.pin("loss_chunk_tokens") or 0  # tp > 1: loss on vocabulary shards
        priced = replace(s, precision=req.precision, attention=attention, loss_chunk_tokens=chunk)
        p = predict(req, priced).predicted
        if device is not None and p.memory_per_gpu_bytes > req.gpu.memory_bytes:
            dropped.append(
                f"{s.label}: {p.memory_per_gpu_bytes / GIB:.1f} GiB per GPU predicted > "
                f"{req.gpu.memory_bytes / GIB:.1f} GiB"
            )
            continue
        fitting.append(Candidate(s, p))
    ranked = sorted(fitting, key=lambda c: -c.predicted.tokens_per_s)  # stable: ties keep the space's order
    if first is not None:
        ranked.sort(key=lambda c: c.setup != first)
    return Pool(ranked, dropped, device, req)


def select(ranked: Sequence[Candidate], k: int) -> list[Candidate]:
    """The predicted best; then per decision (DECISIONS) the best that differs from it in that decision alone;
    then the next best not yet picked; k in all (fewer when the pool is smaller)."""
    if not ranked or k < 1:
        return []
    best = ranked[0]
    picks = [best]
    for decision in DECISIONS:
        if len(picks) >= k:
            break
        alt = next((c for c in ranked if c not in picks and differs_only_in(c.setup, best.setup, decision)), None)
        if alt is not None:
            picks.append(alt)
    for c in ranked:
        if len(picks) >= k:
            break
        if c not in picks:
            picks.append(c)
    return picks
