"""What the planner searches, from the request (torch-free): the values of each decision it chooses where the user did
not pin it (llmctl.spec.decisions: strategy, tp, cp, attention, checkpointing, loss chunk, compile, and the nodes
used), each narrowed by the same rules the plan file and the engine ask (llmctl.spec.rules, the families' tensor- and
context-parallel predicates), and why values were left out (`rejected`, one line each, in the order found).

Tensor-parallel degree (llmctl.families.tensor_parallel.valid_tp: 1, 2, 4, 8 inside a node, where the model's family
has a plan and the degree divides its heads, kv heads and MLP width) x context-parallel degree (1, 2, 4, ... up to the
cluster where the model's attention runs as ring attention, llmctl.families.context_parallel, and 2cp x tp splits the
sequence) x strategy (full_shard, hybrid_shard, no_shard: what the engine runs) x nodes used (powers of two and
divisors of the cluster's node count: on a slow network fewer nodes can win) x checkpointing x attention kernel x
compile x loss chunk (0 with tp > 1: TP computes the loss on vocabulary shards; past LONG_CONTEXT_TOKENS only the
chunked loss). The micro-batch and accumulation are found per family (llmctl.plan.search).

Pipeline parallelism (cp 1; once llmctl's engine runs it, or pinned): pp 1, 2, 4, ... while the layers split
(`pp_degrees`) x schedule and stages per rank (`pp_schedules`: 1f1b, interleaved-1f1b at 2, 4, 8, zbv; gpipe only
pinned); pp microbatches: all of a step's (one schedule run: the least bubble and the fewest FSDP gathers), or the pin.

Expert parallelism (mixture-of-experts models only; dense models search ep 1 alone): ep 1, 2, 4, ... dividing every
MoE layer's routed experts (`ep_degrees`), each family (with pp and cp as they are searched) at the degrees that
divide its dp_shard x cp ranks, at tp 1 and pp 1 for llmctl's engine (rule "ep at tp 1"), in groups the nodes hold
evenly (`family_eps`); or the pin.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from llmctl.errors import DoesNotFitError, InputError, RuleError
from llmctl.families.context_parallel import cp_problem
from llmctl.families.tensor_parallel import valid_tp
from llmctl.plan import float8 as f8
from llmctl.plan import memory as mem
from llmctl.plan.memory.fewest import LOSS_CHUNK_ELEMENTS, auto_loss_chunk, fewest  # noqa: F401 (re-exported)
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import pipeline
from llmctl.spec.attention import KERNELS, Attention
from llmctl.spec.decisions import declared
from llmctl.spec.optimizer_states import AUTO as AUTO_STATES
from llmctl.spec.parallel import ENGINE_STRATEGIES, ParallelDims, sequence_split_problem
from llmctl.spec.pipeline import max_stages
from llmctl.spec.rules import ENGINE_RULES, engine_problem, model_problem
from llmctl.spec.setup import TrainSetup

if TYPE_CHECKING:
    from llmctl.plan.request import PlanRequest
    from llmctl.spec.models import ModelSpec

LONG_CONTEXT_TOKENS = 32768
"""Past this sequence length the planner keeps the loss chunked (tp = 1): the whole logits of one 32k-token sequence
over Llama 3's 128k vocabulary are 7.8 GiB in bf16, 15.7 GiB upcast to fp32 and 15.7 GiB more for the fp32
log-softmax."""


@dataclass(frozen=True)
class Choice:
    """One point of the planner's search: the decisions it chooses (llmctl.spec.decisions with a `search` role, and
    the nodes used), immutable; `setup(req)` is the TrainSetup (the request's `base` with these). The memory search
    reads a choice at micro-batch 1; the planner times it at the largest micro-batch that fits."""

    strategy: str
    nodes: int
    tp: int = 1
    cp: int = 1
    attention: str = "sdpa"
    checkpointing: str = "none"
    loss_chunk_tokens: int = 0
    cp_rotate: str = "allgather"
    compile: bool = False
    async_tp: bool = False
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int | None = None
    pp_microbatches: int | None = None
    ep: int = 1

    def setup(self, req: PlanRequest) -> TrainSetup:
        fields_ = _CHOICE_FIELDS if self.pp > 1 else _FLAT_FIELDS  # pp 1: the pipeline's options at their defaults
        return req.candidate(**{f: getattr(self, f) for f in fields_})

    @classmethod
    def of(cls, setup: TrainSetup) -> Choice:
        """The choice a setup of the search made."""
        return cls(**{f: getattr(setup, f) for f in _CHOICE_FIELDS})

    def at(self, micro_batch: int, per_rank: int) -> Choice:
        """This choice at a micro-batch, accumulating the rest of the per-rank batch."""
        return replace(self, micro_batch_size=micro_batch, grad_accum_steps=max(1, per_rank // micro_batch))

    @property
    def memory(self) -> tuple:
        """What its memory depends on: a full_shard's node count (the others' on one or two), and between SDPA and
        flash not the kernel (MemorySearch's caches)."""
        kernel = "eager" if Attention(self.attention).keeps_scores else "fused"
        n = self.nodes if self.strategy == "full_shard" else min(self.nodes, 2)
        key = (self.tp, self.cp, self.cp_rotate, self.strategy, n, self.checkpointing, kernel, self.loss_chunk_tokens)
        if self.ep > 1:  # the experts a rank holds and the rows it receives (llmctl.spec.experts)
            key = (*key, "ep", self.ep)
        if self.pp > 1:  # a stage's layers and its micro-batches in flight (llmctl.spec.pipeline.in_flight)
            return (*key, self.pp, str(self.pp_schedule), self.pp_virtual_stages, self.pp_microbatches)
        return key

    def where(self) -> str:
        """'full_shard x TP 2 on 1 node' (the search's rejection lines)."""
        par = "".join(
            f" x {k} {v}" for k, v in (("PP", self.pp), ("CP", self.cp), ("TP", self.tp), ("EP", self.ep)) if v > 1
        )
        if self.pp > 1:
            v = f" v {self.pp_virtual_stages}" if self.pp_virtual_stages else ""
            par += f" ({self.pp_schedule}{v})"
        return f"{self.strategy}{par} on {self.nodes} node{'s' if self.nodes > 1 else ''}"


_CHOICE_FIELDS = tuple(f.name for f in fields(Choice))
_FLAT_FIELDS = tuple(f for f in _CHOICE_FIELDS if not f.startswith("pp_"))


TP_REFUSED = {
    "loss parallel": lambda req: (
        f"tensor parallelism: --loss-chunk {req.pin('loss_chunk_tokens')} (TP computes the loss unchunked)"
    ),
    "adapters": lambda req: f"tensor parallelism: {req.finetune.method} adapters run at tp 1 in llmctl's engine",
}
"""How the search words a rule (llmctl.spec.rules) that leaves only tp 1."""


def checkpointing_modes(spec: ModelSpec) -> list[str]:
    """What the planner tries: none, partial:K (where they checkpoint a distinct number of layers), selective, full."""
    out = ["none"]
    seen = set()
    for k in ckpt_modes.PLANNER_PARTIAL:
        n = spec.num_layers // k
        if 0 < n < spec.num_layers and n not in seen:
            seen.add(n)
            out.append(f"partial:{k}")
    return out + ["selective", "full"]


def tp_degrees(req: PlanRequest, rejected: list[str]) -> list[int]:
    """The tensor-parallel degrees to search: the pin, or valid_tp, each degree's setup asked to the rules (a
    sequence it splits evenly, no pinned loss chunk, what the engine runs with adapters)."""
    if req.pin("tp") is not None:
        return [req.pin("tp")]  # checked by PlanRequest
    tps, refused = [1], {}
    for t in valid_tp(req.spec, req.gpus_per_node)[1:]:
        try:
            req.candidate(nodes=req.nodes, tp=t, loss_chunk_tokens=req.pin("loss_chunk_tokens") or 0)
        except RuleError as e:
            refused.setdefault(e.rule, []).append(t)
            continue
        tps.append(t)
    if "sequence split" in refused:
        uneven = ", ".join(map(str, refused["sequence split"]))
        rejected.append(f"tensor parallelism {uneven}: seq len {req.seq_len} does not divide")
    for rule, words in TP_REFUSED.items():
        if rule in refused:
            rejected.append(words(req))
            break
    return tps


def cp_degrees(req: PlanRequest, attns: list[Attention], rejected: list[str]) -> list[int]:
    """The context-parallel degrees to search: the pin, or 1 and the powers of two up to the cluster's GPUs whose
    ring the model's attention runs (llmctl.families.context_parallel.cp_problem) on a kernel that runs a ring (a
    pinned flash or eager kernel rules it out), and whose 2cp head-tail chunks split the sequence (each rank's part
    split again by some tp searched: parallel_degrees)."""
    if req.pin("cp") is not None:
        return [req.pin("cp")]  # checked by PlanRequest
    world = req.nodes * req.gpus_per_node
    if world < 2:
        return [1]
    problem = cp_problem(req.spec, req.seq_len)
    if problem:
        rejected.append(f"context parallelism: {problem}")
        return [1]
    if not any(a.runs_ring for a in attns):
        rejected.append(f"context parallelism: ring attention runs on SDPA, not --attention {req.pin('attention')}")
        return [1]
    cps, cp = [1], 2
    while cp <= world:
        if world % cp == 0 and sequence_split_problem(req.seq_len, 1, cp) is None:
            cps.append(cp)
        cp *= 2
    return cps


def parallel_degrees(req: PlanRequest, tps: list[int], cps: list[int], rejected: list[str]) -> list[tuple[int, int]]:
    """The (tp, cp) pairs to search: those that split the GPUs and the sequence (llmctl.spec.parallel)."""
    world, out = req.nodes * req.gpus_per_node, []
    for tp, cp in itertools.product(tps, cps):
        if world % (tp * cp):
            continue
        problem = sequence_split_problem(req.seq_len, tp, cp)
        if problem:
            rejected.append(f"cp {cp} x tp {tp}: {problem}")
            continue
        out.append((tp, cp))
    return out


def loss_chunks(req: PlanRequest, rejected: list[str]) -> list[int]:
    """The loss chunks to search (tp = 1; tp > 1 computes the loss on vocabulary shards): the pin, else whole logits
    and auto_loss_chunk, but past LONG_CONTEXT_TOKENS only the chunked loss (it stays on: the logits of one long
    sequence are many GiB, and a plan that runs at one length should not lose the chunks at the next)."""
    if req.pin("loss_chunk_tokens") is not None:
        return [req.pin("loss_chunk_tokens")]
    if req.seq_len > LONG_CONTEXT_TOKENS:
        rejected.append(
            f"whole logits (--loss-chunk 0): past {LONG_CONTEXT_TOKENS:,} tokens the loss stays chunked "
            f"(tp > 1: on vocabulary shards)"
        )
        return [auto_loss_chunk(req.spec)]
    return [0, auto_loss_chunk(req.spec)]


def attention_kernels(req: PlanRequest, rejected: list[str]) -> list[Attention]:
    """The kernels to search: the pin, else every kernel, without flash where the precision or GPU has none, and
    without what the model has no path for (a pinned one it has not is bad input)."""
    pin = req.pin("attention")
    attns = [pin] if pin else list(KERNELS)
    gpu = req.gpu
    if not req.precision.flash_attention or not gpu.flash_attention:
        why = (
            f"{req.compute_dtype} has no flash kernel"
            if not req.precision.flash_attention
            else f"flash-attention 2 does not run on {gpu.name}"
        )
        if pin == Attention.FLASH:
            rejected.append(f"--attention flash: {why}")
        attns = [a for a in attns if a != Attention.FLASH]
    if pin and not req.spec.runs_kernel(pin):  # a pin the model cannot run: bad input
        raise InputError(
            f"--attention {pin}: {req.spec.name} ({req.spec.model_type}) has no {pin} path in transformers",
            hint=f"use --attention {req.spec.attention_kernel(pin)}, or no pin",
        )
    return [a for a in attns if req.spec.runs_kernel(a)]


def dp_ranks(req: PlanRequest, n: int, tp: int, cp: int, pp: int = 1) -> int:
    """Data-parallel ranks on n nodes (0: tp x cp x pp does not split them)."""
    k = tp * cp * pp
    return n * req.gpus_per_node // k if (n * req.gpus_per_node) % k == 0 else 0


PP_WITH_CP = "pipeline parallelism is planned at cp 1 (a pipeline whose stages run ring attention is not priced)"
PP_WITH_CP_HINT = "pin --pp or --cp, not both"


def pp_degrees(req: PlanRequest, tps: list[int], rejected: list[str]) -> list[int]:
    """The pipeline-parallel degrees to search: the pin, or 1 and the powers of two while the model's layers split
    into that many stages (llmctl.spec.pipeline.max_stages: the embedding and head count as one layer each), the
    degree divides the GPUs with some tp searched, and what the request trains runs with it (the rules: adapters stay
    at pp 1; llmctl's engine, llmctl.spec.rules.ENGINE_RULES, runs pipelines)."""
    if req.pin("pp") is not None:
        if req.pin("pp") > 1 and (req.pin("cp") or 1) > 1:  # every family of a pipeline is cp 1 (module doc)
            raise InputError(f"--pp {req.pin('pp')} with --cp {req.pin('cp')}: {PP_WITH_CP}", hint=PP_WITH_CP_HINT)
        return [req.pin("pp")]
    world, most = req.nodes * req.gpus_per_node, max_stages(req.spec.num_layers)
    if world % 2:
        return [1]
    try:
        # enough micro-batches a run for every schedule (1F1B needs pp of them: an engine rule), so the probe asks
        # only whether the engine runs pipelines for this request, not about the batch
        probe = req.candidate(nodes=req.nodes, pp=2, grad_accum_steps=2)
    except RuleError as e:
        rejected.append(f"pipeline parallelism: {e.message}")
        return [1]
    if engine_problem(probe) is not None:
        # What llmctl's engine does not run is not proposed (a pinned --pp is priced all the same); silent, so that
        # plans stay as they were until the engine runs pipelines.
        return [1]
    if (err := model_problem(probe, req.spec, only=("pp split",))) is not None:
        # the model itself cannot be cut (tied embeddings, a base forward that rewrites its input embeddings)
        rejected.append(err.message if err.message.startswith("pipeline") else f"pipeline parallelism: {err.message}")
        return [1]
    if req.pin("offload"):
        return [1]  # CPU offload's states on the host: not searched with a pipeline (not a reason nothing fits)
    pps, pp = [1], 2
    while pp <= most and any(world % (pp * t) == 0 for t in tps):
        pps.append(pp)
        pp *= 2
    return pps


def ep_degrees(req: PlanRequest, rejected: list[str]) -> list[int]:
    """The expert-parallel degrees to search: the pin, or for a mixture-of-experts model 1 and the powers of two up
    to the cluster's GPUs that divide every MoE layer's routed experts (rule "ep split"), where what the request trains
    runs with it (adapters stay at ep 1). A dense model: [1], silently (its plans stay as they were). Which of them a
    family takes is `family_eps`."""
    if req.pin("ep") is not None:
        return [req.pin("ep")]
    spec = req.spec
    if not spec.moe or spec.measured is not None:
        return [1]
    world = req.nodes * req.gpus_per_node
    try:
        req.candidate(nodes=req.nodes, strategy="full_shard", ep=2)
    except (RuleError, InputError) as e:
        rejected.append(f"expert parallelism: {e.message}")
        return [1]
    experts = {la.mlp.num_experts for la in spec.layers if la.mlp.moe}
    eps, ep = [1], 2
    while ep <= world and all(e % ep == 0 for e in experts):
        eps.append(ep)
        ep *= 2
    return eps


def ep_placement_problem(ep: int, gpus_per_node: int) -> str | None:
    """Why an ep group of consecutive ranks would not sit evenly on the nodes (None: inside one node, or on whole
    nodes): the all-to-all's price (llmctl.plan.network.alltoall_time) counts the same ranks of a group on each node."""
    if (ep <= gpus_per_node and gpus_per_node % ep == 0) or ep % gpus_per_node == 0:
        return None
    return f"ep {ep} groups would straddle nodes of {gpus_per_node} GPUs"


def family_eps(req: PlanRequest, f: Choice, eps: list[int], rejected: list[str]) -> list[int]:
    """The expert-parallel degrees a (strategy, nodes, tp, cp, pp) family takes of `eps`: those that divide its
    dp_shard x cp ranks (ep borrows them: llmctl.spec.parallel.ParallelDims), that llmctl's engine runs (rule "ep at
    tp 1": tp 1, and pp 1 for now), in groups the nodes hold evenly. A pinned degree the family cannot take is said in
    `rejected`; unpinned, the family simply runs at the degrees it takes (ep 1 always)."""
    if eps == [1]:
        return eps
    pinned = req.pin("ep") is not None
    out = []
    for ep in eps:
        why = None
        if ep > 1:
            shard = _fsdp_shard(req, f)
            why = ep_placement_problem(ep, req.gpus_per_node)
            if not shard or shard % ep:
                why = f"ep {ep} must divide the ranks it borrows from: dp_shard x cp = {shard}"
            why = why or _ep_engine_problem(req, f, ep)
        if why is None:
            out.append(ep)
        elif pinned:
            rejected.append(f"{replace(f, ep=ep).where()}: {why}")
    return out


EP_ENGINE_RULE = next(r for r in ENGINE_RULES if r.name == "ep at tp 1")
"""What llmctl's engine runs expert parallelism with (tp 1, pp 1 for now): the rule the plan check and the engine ask."""


def _ep_engine_problem(req: PlanRequest, f: Choice, ep: int) -> str | None:
    """Why llmctl's engine does not run a family at `ep` (the rule "ep at tp 1"), or None."""
    if f.tp == 1 and f.pp == 1:
        return None  # what the rule allows: no setup to build
    try:
        probe = req.candidate(
            strategy=f.strategy, nodes=f.nodes, tp=f.tp, cp=f.cp, pp=f.pp, ep=ep, grad_accum_steps=2 * f.pp
        )
    except (RuleError, InputError) as e:
        return e.message  # not a layout (hybrid on one node, ...): the family's own search says so
    err = EP_ENGINE_RULE.problem(probe)
    return None if err is None else err.message


def largest_ep(req: PlanRequest, f: Choice, eps: list[int]) -> int:
    """The largest expert-parallel degree a family takes (1 if none but ep 1): its fastest compute (the grouped GEMMs
    and FSDP's fewest copies) and least memory, what the search's bounds read a family at."""
    return max(family_eps(req, f, eps, []), default=1)


def _fsdp_shard(req: PlanRequest, f: Choice) -> int:
    """dp_shard x cp of a family's degrees (0 where they do not split the GPUs)."""
    try:
        dims = ParallelDims.from_strategy(f.strategy, f.nodes, req.gpus_per_node, f.tp, f.pp, cp=f.cp)
    except (RuleError, InputError):
        return 0
    return dims.fsdp_shard


VIRTUAL_STAGES = (2, 4, 8)
"""Stages per rank the search tries for interleaved 1F1B (Megatron's and torchtitan's recipes run 2 to 8)."""


def pp_schedules(req: PlanRequest, rejected: list[str]) -> list[tuple[str, int | None]]:
    """(schedule, stages per rank) pairs to search under pp > 1: the pinned schedule, else 1F1B, interleaved 1F1B at
    each of VIRTUAL_STAGES (the split rule drops what a model's layers cannot take), and ZB-V. GPipe only when
    pinned: it idles as much as 1F1B and holds every micro-batch's activations, so it never wins."""
    pin, v = req.pin("pp_schedule"), req.pin("pp_virtual_stages")
    if pin is not None:
        sched = pipeline.schedule(pin)
        if sched is pipeline.Schedule.INTERLEAVED_1F1B and v is None:
            return [(str(sched), w) for w in VIRTUAL_STAGES]
        return [(str(sched), v)]
    # GPipe is not searched unpinned (1F1B's bubble with every micro-batch held: it never wins); not a rejection
    # reason of its own, so nothing is said in a "no setup satisfies" line
    looped = [("interleaved-1f1b", w) for w in ((v,) if v else VIRTUAL_STAGES)]
    return [("1f1b", None), *looped, ("zbv", None)]


@dataclass(frozen=True)
class Space:
    """The values the search tries for each decision it chooses, and why others were left out."""

    strategies: list[str]
    checkpointing: list[str]
    loss_chunks: list[int]
    attentions: list[Attention]
    compiles: list[bool]
    tps: list[int]
    cps: list[int]
    degrees: list[tuple[int, int]]
    """(tp, cp) pairs that split the GPUs and the sequence."""
    usable: dict[tuple[int, int], list[int]]
    """(tp, cp) -> the node counts whose data-parallel ranks split the global batch."""
    rejected: list[str] = field(default_factory=list)
    pps: list[int] = field(default_factory=lambda: [1])
    """Pipeline-parallel degrees (1: off)."""
    schedules: list[tuple[str, int | None]] = field(default_factory=list)
    """(schedule, stages per rank) tried under pp > 1."""
    pp_usable: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    """(tp, pp > 1) -> the node counts whose data-parallel ranks (cp 1) split the global batch."""
    eps: list[int] = field(default_factory=lambda: [1])
    """Expert-parallel degrees (1: off); each family takes those that divide its ranks (`family_eps`)."""


def space_for(req: PlanRequest) -> Space:
    """The space of a request (the pins narrow it; the rules and the batch too)."""
    spec, g, G = req.spec, req.gpus_per_node, req.global_batch
    req.gpu.peak_tflops(req.compute_dtype)  # no native dtype (bf16 on V100): one clear error now
    if req.precision.float8 and spec.measured is None and not f8.linear_count(spec):
        # as the engine refuses it (llmctl.engine.float8.convert): float8 would buy nothing
        raise InputError(
            f"precision {req.precision.name}: {spec.name} has no linear layer float8 converts "
            "(GPT-2's projections are Conv1D, not nn.Linear)",
            hint="use --precision bf16-mixed",
        )
    rejected: list[str] = []
    strategy, ckpt, comp = req.pin("strategy"), req.pin("checkpointing"), req.pin("compile")
    chunks = loss_chunks(req, rejected)
    attns = attention_kernels(req, rejected)
    if strategy == "hybrid_shard" and req.nodes < 2:
        rejected.append("--strategy hybrid_shard: needs at least 2 nodes (on one node it is full_shard)")
    tps = tp_degrees(req, rejected)
    cps = cp_degrees(req, attns, rejected)
    degrees = parallel_degrees(req, tps, cps, rejected)
    usable = {
        (tp, cp): [n for n in req.node_options() if dp_ranks(req, n, tp, cp) and G % dp_ranks(req, n, tp, cp) == 0]
        for tp, cp in degrees
    }
    if not any(usable.values()):
        tp, cp = max(degrees, key=lambda d: d[0] * d[1]) if degrees else (max(tps), 1)
        dp = max(1, g // (tp * cp))  # the fewest data-parallel ranks per node searched
        ranks = f"{dp} GPUs per node" if dp == g else f"{dp} data-parallel ranks per node (tp {tp} x cp {cp})"
        raise InputError(
            f"global batch {G} sequences does not split evenly over {ranks} on any node count",
            hint=f"use a multiple of {dp} (e.g. --global-batch {dp * max(1, round(G / dp))})",
        )
    for tp, cp in degrees:
        dp = dp_ranks(req, req.nodes, tp, cp)
        if dp and req.nodes not in usable[(tp, cp)]:
            ranks = f"{dp} GPUs" if tp * cp == 1 else f"{dp} data-parallel ranks (tp {tp} x cp {cp})"
            rejected.append(f"{req.nodes} nodes: global batch {G} is not a multiple of {ranks}")
    pps = pp_degrees(req, [t for t, c in degrees if c == 1], rejected)
    pp_usable = {
        (tp, pp): [
            n for n in req.node_options() if dp_ranks(req, n, tp, 1, pp) and G % dp_ranks(req, n, tp, 1, pp) == 0
        ]
        for tp, cp in degrees
        if cp == 1
        for pp in pps
        if pp > 1
    }
    return Space(
        eps=ep_degrees(req, rejected),
        pps=pps,
        schedules=pp_schedules(req, rejected) if len(pps) > 1 or pps[0] > 1 else [],
        pp_usable=pp_usable,
        strategies=[strategy] if strategy else list(ENGINE_STRATEGIES),
        checkpointing=[ckpt] if ckpt else checkpointing_modes(spec),
        loss_chunks=chunks,
        attentions=attns,
        compiles=[comp] if comp is not None else [True, False],
        tps=tps,
        cps=cps,
        degrees=degrees,
        usable=usable,
        rejected=rejected,
    )


# --- CPU offload's bound, and what fits when nothing in the space does -------------------------------------------
def fastest_families(req: PlanRequest) -> list[Choice]:
    """The search's (tp, cp, strategy, nodes) families, each at its fastest: the whole per-rank batch (or the pinned
    micro-batch), the least recompute and loss chunk searched, the fastest kernel allowed, compiled where it may be,
    the largest expert-parallel degree it takes (what llmctl.plan.search.offload_can_win bounds offload with)."""
    spec, rejected = req.spec, []
    fast = Attention.FLASH if req.precision.flash_attention and req.gpu.flash_attention else Attention.SDPA
    fast = spec.attention_kernel(req.pin("attention") or fast)
    strategies = [req.pin("strategy")] if req.pin("strategy") else list(ENGINE_STRATEGIES)
    chunk = min(loss_chunks(req, rejected))
    eps = ep_degrees(req, rejected)
    out = []
    for tp, cp in parallel_degrees(
        req, tp_degrees(req, rejected), cp_degrees(req, [fast, Attention.SDPA], rejected), rejected
    ):
        for n, strategy in itertools.product(req.node_options(), strategies):
            dp = dp_ranks(req, n, tp, cp)
            hybrid_off = strategy == "hybrid_shard" and (
                n < 2 or req.gpus_per_node % (tp * cp) or req.gpus_per_node // (tp * cp) < 2
            )
            if dp and not req.global_batch % dp and not hybrid_off:
                kernel = fast if cp == 1 else Attention.SDPA
                f = Choice(strategy, n, tp, cp, attention=kernel, loss_chunk_tokens=0 if tp > 1 else chunk)
                out.append(replace(f, ep=largest_ep(req, f, eps)))
    return out


def pin_flags(req: PlanRequest, skip: tuple[str, ...] = ()) -> list[str]:
    """The request's pins as the flags that give them (`--tp 2`, `--no-compile`), in their declaration order."""
    out = []
    for d in declared(TrainSetup):
        v = req.pin(d.name)
        if v is None or d.name in skip or not d.flag:
            continue
        out.append(d.spell(v))
    return out


def nothing_fits(req: PlanRequest, rejected: list[str], offload_pinned: bool = True) -> None:
    pinned = pin_flags(req, skip=() if offload_pinned else ("offload",))
    unique = list(dict.fromkeys(rejected))
    reasons = "; ".join(unique[:3]) + (f" (+{len(unique) - 3} more)" if len(unique) > 3 else "") or "no candidate"
    host_reasons = [r for r in unique if "host memory" in r] if req.pin("offload") else []
    smaller = ""  # CPU offload's host memory: the states' own lever
    if host_reasons and req.optimizer_states == AUTO_STATES and req.precision.optimizer_state_dtype == "fp32":
        smaller = ", or --optimizer-states bf16: AdamW's moments in bf16, 4 bytes a parameter less on the host"
    if pin_flags(req, skip=("offload",)):  # pins of the setup itself (an offload pin the fewest search keeps)
        hint = "drop a pin to let the planner choose"
        if host_reasons:
            hint = "use more nodes (each holds its GPUs' share of the states on the host)" + smaller
        raise DoesNotFitError(f"no setup satisfies {' '.join(pinned)}: {reasons}", hint=hint)
    best_attn = req.spec.attention_kernel(
        Attention.FLASH if req.precision.flash_attention and req.gpu.flash_attention else Attention.SDPA
    )
    chunk = loss_chunks(req, [])[-1]
    setup = req.candidate(checkpointing="full", attention=best_attn, loss_chunk_tokens=chunk)
    host = req.host_capacity_bytes if req.pin("offload") else None
    where = f"{req.nodes} x {req.gpus_per_node} {req.gpu.name}"
    # the fewest over every layout the planner could pick (tp, cp, pp: llmctl.plan.memory.fewest), not only the request's
    f = fewest(req.spec, setup, req.capacity_bytes, host_memory_bytes=host)
    if f is None:
        m = mem.min_gpus(req.spec, setup, req.capacity_bytes, "full_shard", host_memory_bytes=host)
        raise DoesNotFitError(
            f"{req.spec.name} does not fit on {where} in any setup, nor on any number of {req.gpu.name} in any "
            f"layout of tensor, context or pipeline parallelism ({m.note})",
            hint="use a GPU with more memory",
        )
    why = f" ({host_reasons[0]})" if host_reasons else ""
    raise DoesNotFitError(
        f"{req.spec.name} does not fit on {where} in any setup{why}; the smallest cluster of "
        f"{req.gpu.name} that fits is {f.shape(req.gpus_per_node)} ({f.gpus} GPUs) with {f.words()}",
        hint=f"pass --gpus {f.gpus} or more" + (f" (--nodes {f.nodes})" if f.nodes > 1 else "") + smaller,
        fewest_gpus=f.gpus,
    )
