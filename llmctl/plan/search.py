"""The planner's search (torch-free): a point of it is one immutable `Choice`; `Search` runs the families of a space
(llmctl.plan.space) and keeps each family's best; `MemorySearch` finds the largest micro-batch that fits each choice
(memory.max_micro_batch), cached across the strategies and node counts that share it, and the micro-batches worth
timing; the bounds let the search skip a tensor- or context-parallel family that cannot win, an expert-parallel degree
whose compute and all-to-alls alone cannot (`ep_bound`), and CPU offload where it cannot win. Each family runs at the
expert-parallel degrees it takes (llmctl.plan.space.family_eps; ep 1 alone for a dense model), and the bounds read a
family at its largest (its fastest compute and least memory)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from llmctl.plan import experts as ex
from llmctl.plan import kernel_time, stages
from llmctl.plan import memory as mem
from llmctl.plan import offload as ol
from llmctl.plan.ranking import recompute_seconds, sort_key
from llmctl.plan.request import PlanRequest
from llmctl.plan.space import Choice, Space, dp_ranks, family_eps, largest_ep
from llmctl.plan.timing import Candidate, compute_times, cp_comm, evaluate
from llmctl.spec import pipeline
from llmctl.spec.attention import Attention
from llmctl.spec.decisions import search_key
from llmctl.spec.models import ModelSpec
from llmctl.spec.pipeline import max_stages
from llmctl.spec.setup import CP_ROTATES, TrainSetup
from llmctl.units import GIB


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def parallel_bound(req: PlanRequest, choice: Choice) -> float:
    """An upper bound on what a tp x cp > 1 family predicts (tokens/s, or per GPU for the cost objective): its compute
    alone at the largest micro-batch (the GEMM efficiency only grows with it), without recompute or communication
    (both only add time)."""
    per_rank = req.global_batch // (choice.nodes * req.gpus_per_node // (choice.tp * choice.cp))
    mb = req.pin("micro_batch_size") or per_rank
    setup = (
        replace(choice, strategy="full_shard", checkpointing="none", loss_chunk_tokens=0).at(mb, per_rank).setup(req)
    )
    _, fwd, bwd = compute_times(req, setup)
    tps = setup.tokens_per_step / (setup.grad_accum_steps * (fwd + bwd))
    return tps if req.objective == "throughput" else tps / setup.gpus


def ep_bound(req: PlanRequest, choice: Choice) -> float:
    """An upper bound on what an ep > 1 family without a pipeline predicts (tokens/s, or per GPU for the cost
    objective): its compute alone at the largest micro-batch without recompute (as `parallel_bound`), plus its
    all-to-alls there, which nothing hides (llmctl.plan.experts.ep_comm: the fewest micro-batches, the fewest
    latencies); FSDP's communication and recompute only add time."""
    per_rank = req.global_batch // (choice.nodes * req.gpus_per_node // (choice.tp * choice.cp))
    mb = req.pin("micro_batch_size") or per_rank
    setup = replace(choice, checkpointing="none", loss_chunk_tokens=0).at(mb, per_rank).setup(req)
    _, fwd, bwd = compute_times(req, setup)
    a2a = ex.ep_comm(req.spec, setup, req.seq_len, req.network).exposed_s
    return _metric(req, setup, setup.grad_accum_steps * (fwd + bwd) + a2a)


def offload_can_win(req: PlanRequest, best: Candidate, families: list[Choice]) -> bool:
    """Whether some CPU-offload setup could beat `best`, the best setup without offload. An offload setup takes at
    least as long as the same setup without it plus the host's optimizer step (llmctl.plan.offload: its copies and
    host work only add time), and that setup at best as long as its family's fastest: the whole per-rank batch
    without recompute, compiled (the search's own rule: a larger micro-batch and less recompute are faster). Where
    that fastest setup fits the GPUs without offload, the first search had it (or pruned its family as slower) and
    offload adds time to it; elsewhere its step plus the host step bounds the family. Cheapest tests first: the
    compute alone, then the memory, then the whole step. `families`: each (tp, cp, strategy, nodes) family with the
    kernel and loss chunk of its fastest setup."""
    target = -sort_key(req, best)[0]
    comp = req.pin("compile") if req.pin("compile") is not None else True  # compile fuses memory-bound ops
    ckpt = req.pin("checkpointing") or "none"
    search = MemorySearch(req.with_pins(offload=True))
    for f in families:
        per_rank = req.global_batch // (f.nodes * req.gpus_per_node // (f.tp * f.cp))
        mb = req.pin("micro_batch_size") or per_rank
        fast = replace(f, checkpointing=ckpt, compile=comp, async_tp=f.tp > 1 and comp and req.async_tp)
        setup = fast.at(mb, per_rank).setup(req)
        host = ol.offload_time(req.gpu, req.spec, replace(setup, levers=ol.ON), 0.0, 0.0, [], 1.0).optimizer_s
        _, fwd, bwd = compute_times(req, setup)
        if _metric(req, setup, setup.grad_accum_steps * (fwd + bwd) + host) <= target:
            continue
        if mem.estimate(req.spec, mem.memory_key(setup)).device_bytes <= req.capacity_bytes:
            continue  # fits without offload: searched as it is
        if search.host_problem(f):
            continue  # the host cannot hold its states
        # the GPU's own optimizer step, which offload moves to the host, leaves the bound
        gpu_step = kernel_time.optimizer_seconds(req.gpu, req.spec, setup) / req.efficiency.calibration
        if _metric(req, setup, evaluate(req, setup).predicted.step_time_s - gpu_step + host) > target:
            return True
    return False


def probe_accum(choice: Choice) -> int:
    """The accumulation the memory search sizes a choice at: 2 (gradients live in the forward), or under pp enough
    micro-batches a run that every schedule holds its most in flight (llmctl.spec.pipeline.in_flight: at most
    (v + 1) pp stage-micro-batches, reached with 2 pp micro-batches), a multiple of pinned pp microbatches."""
    if choice.pp == 1:
        return 2
    m = choice.pp_microbatches
    return 2 * choice.pp if m is None else m * -(-2 * choice.pp // m)


def pipeline_bound(
    req: PlanRequest, choice: Choice, schedules: list[tuple[str, int | None]], times: dict[tuple, tuple[float, float]]
) -> dict[tuple[str, int | None], float]:
    """Per schedule, an upper bound on what a pp > 1 family predicts with it (tokens/s, or per GPU for the cost
    objective): the best, over the micro-batches that divide the per-rank batch, of the heaviest rank's least share
    of the compute (its smallest of matmul, attention and parameter shares, llmctl.plan.stages.RankShare) without
    recompute or communication, plus the schedule's bubble at that many micro-batches (ZB-V's with the largest W it
    can have, the forward). Communication, recompute and a larger share only add time. `times`: the whole model's
    micro-batch times by (tp, kernel, compile, micro-batch), shared across pp and nodes."""
    dp = dp_ranks(req, choice.nodes, choice.tp, 1, choice.pp)
    per_rank, p = req.global_batch // dp, choice.pp
    pinned = req.pin("micro_batch_size")
    scale = 1.0 if req.objective == "throughput" else 1 / (choice.nodes * req.gpus_per_node)
    shares = {}
    for sched, v in schedules:
        probe = req.candidate(nodes=choice.nodes, tp=choice.tp, pp=p, pp_schedule=sched, pp_virtual_stages=v)
        share = stages.heaviest_rank(req.spec, probe)
        shares[(sched, v)] = min(share.matmul, share.attention, share.params)
    best = dict.fromkeys(shares, 0.0)
    for mb in [pinned] if pinned else divisors(per_rank):
        key = (choice.tp, choice.attention, choice.compile, mb, choice.ep)
        if key not in times:
            flat = replace(choice, strategy="full_shard", checkpointing="none", loss_chunk_tokens=0, pp=1)
            times[key] = compute_times(req, flat.at(mb, per_rank).setup(req))[1:]
        fwd, bwd = times[key]
        m = per_rank // mb
        if m < 1:  # a pinned micro-batch larger than a rank's share of the batch: no schedule run (said elsewhere)
            continue
        for (sched, v), share in shares.items():
            f, b = fwd * share, bwd * share
            if f + b <= 0:  # the heaviest rank holds none of some kind (a head-only stage): nothing to bound with
                best[(sched, v)] = float("inf")
                continue
            idle = stages.bubble(pipeline.schedule(sched), p, m, v or 2, f, b, f)
            tps = per_rank * req.seq_len * dp / (m * (f + b) * (1 + idle)) * scale
            best[(sched, v)] = max(best[(sched, v)], tps)
    return best


def _metric(req: PlanRequest, setup: TrainSetup, step_s: float) -> float:
    """What the objective ranks by for a step of `step_s`: tokens/s, or tokens/s per GPU (cost)."""
    tps = setup.tokens_per_step / step_s
    return tps if req.objective == "throughput" else tps / setup.gpus


_SHARED: dict[tuple, tuple[ModelSpec, dict, dict, dict]] = {}


def _shared_caches(req: PlanRequest) -> tuple[dict, dict, dict]:
    """The memory search's caches, shared by every request whose memory answers are the same: the same spec (by
    identity, held by the entry), GPU capacity, precision, optimizer states, GPUs per node, sequence, offload and
    training method. The cached values depend on nothing else (estimates of setups built from those; the micro-batch
    search's limit is part of its key), so plans of one GPU kind at several node counts (llmctl.plan.compare, tune)
    reuse hybrid and no_shard's searches, which do not depend on the node count."""
    key = (
        id(req.spec),
        req.capacity_bytes,
        req.precision,
        req.optimizer_states,
        req.gpus_per_node,
        req.seq_len,
        bool(req.pin("offload")),
        req.finetune,
    )
    entry = _SHARED.get(key)
    if entry is None or entry[0] is not req.spec:
        if len(_SHARED) >= 8:
            _SHARED.clear()
        entry = _SHARED[key] = (req.spec, {}, {}, {})
    return entry[1], entry[2], entry[3]


class MemorySearch:
    """The largest micro-batch per setup (memory.max_micro_batch), cached: memory depends on the shard degree, not on
    the node count, for hybrid and no_shard, so those share one search."""

    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.cache, self.needs, self.wholes = _shared_caches(req)
        self.hosts: dict[tuple, str | None] = {}

    def host_problem(self, choice: Choice) -> str | None:
        """Under CPU offload, why a family's states do not fit the host's memory per node (None: they fit, or the
        node's memory is not known). They depend on the shard degree only: not on the micro-batch, checkpointing or
        kernel (cached; a full_shard's on its node count, the others' on one or two)."""
        req, cap = self.req, self.req.host_capacity_bytes
        f = Choice(choice.strategy, choice.nodes, choice.tp, choice.cp)
        key = f.memory[:5]
        if cap is None:
            return None
        if key not in self.hosts:
            est = mem.estimate(req.spec, replace(f, checkpointing="full").setup(req))
            self.hosts[key] = None
            if est.host_bytes > cap:
                g = req.gpus_per_node
                where = (
                    f"the cluster's node_memory_gib {req.node_memory_gib:g}"
                    if req.node_memory_gib is not None
                    else f"{req.gpu.name}'s node in the GPU catalog: {req.gpu.node_memory_gib_per_gpu} GiB per GPU"
                )
                self.hosts[key] = (
                    f"{f.where()} with CPU offload: host memory {est.host_node_bytes / GIB:,.0f} GiB per node "
                    f"({est.host_bytes / GIB:.1f} GiB per GPU: parameters, gradients and optimizer states) > "
                    f"{cap * g / GIB:,.0f} GiB ({where})"
                )
        return self.hosts[key]

    def need(self, choice: Choice, accumulating: bool = True) -> int:
        """Bytes per GPU at micro-batch 1: need_estimate's device bytes."""
        return self.need_estimate(choice, accumulating).device_bytes

    def need_estimate(self, choice: Choice, accumulating: bool = True) -> mem.MemoryEstimate:
        """The estimate at micro-batch 1 (cached; a full_shard's on its node count, the others' on one or two), with
        gradient accumulation (the gradients live in the forward) unless `accumulating` is False; max_micro_batch
        starts from it."""
        key = (*choice.memory, accumulating)
        if key not in self.needs:
            one = replace(
                choice,
                compile=False,
                async_tp=False,
                micro_batch_size=1,
                grad_accum_steps=probe_accum(choice) if accumulating else 1,
            )
            self.needs[key] = mem.estimate(self.req.spec, one.setup(self.req))
        return self.needs[key]

    def ring_bound(
        self,
        family: Choice,
        strategies: list[str],
        options: list[tuple[str, int]],
        chunks: list[int],
        compile_: bool,
        eps: list[int] = (1,),
    ) -> float:
        """An upper bound on what a cp > 1 family (`family`: its tp, cp and nodes) predicts (tokens/s, or per GPU for
        the cost objective): the options (checkpointing x loss chunk, cheapest recompute first) before the first
        that fits micro-batch 1 with some strategy cannot run; every setup of the family runs one of the rest, at
        most at the largest micro-batch, and takes at least its compute time there plus its ring's exposed exchanges
        (FSDP's and TP's communication only add). Infinite when none fits (the family's search then says why). `eps`: the
        expert-parallel degrees searched; each strategy is asked at the largest it takes (its least memory), the
        compute at the family's (its fastest)."""
        req, g = self.req, self.req.gpus_per_node
        tp, cp, n = family.tp, family.cp, family.nodes
        allowed = [o for o in options if (o[1] == 0 if tp > 1 else o[1] in chunks)]
        strats = [st for st in strategies if st != "hybrid_shard" or (n > 1 and g % (tp * cp) == 0)]
        ring = replace(family, attention="sdpa", cp_rotate="alltoall")

        def fits(ckpt: str, chunk: int) -> bool:
            cap = req.capacity_bytes  # an upper bound: micro-batch 1 with no accumulation, the least memory
            at = replace(ring, checkpointing=ckpt, loss_chunk_tokens=chunk)
            for st in strats:  # each strategy at the largest ep it takes (its least memory)
                f = replace(at, strategy=st, ep=1)
                if self.need(replace(f, ep=largest_ep(req, f, list(eps))), False) <= cap:
                    return True
            return False

        first = next((i for i, o in enumerate(allowed) if fits(*o)), None)
        if first is None:
            return float("inf")  # nothing fits: searched, so that its reasons are recorded
        per_rank = req.global_batch // (n * g // (tp * cp))
        mb = req.pin("micro_batch_size") or per_rank
        least = float("inf")  # the least compute time per step of the options that can run
        for ckpt, chunk in allowed[first:]:
            at = replace(family, strategy="full_shard", attention="sdpa", compile=compile_, cp_rotate="allgather")
            setup = replace(at, checkpointing=ckpt, loss_chunk_tokens=chunk).at(mb, per_rank).setup(req)
            eff, fwd, bwd = compute_times(req, setup)
            least = min(least, setup.grad_accum_steps * (fwd + bwd))
        # The ring's exposure without recompute (which only runs the forward ring again), at the largest micro-batch
        # (the fewest steps: least latency per token), by the rotation that hides more.
        flat = replace(setup, checkpointing="none")
        exposed = min(cp_comm(req, replace(flat, cp_rotate=r), eff).exposed_s for r in CP_ROTATES)
        tps = setup.tokens_per_step / (least + exposed)
        return tps if req.objective == "throughput" else tps / setup.gpus

    def max_mb(self, choice: Choice, per_gpu: int) -> int:
        """The largest micro-batch to try: the largest that fits with accumulation, or the whole per-rank batch when
        it fits as one micro-batch (no accumulation: no gradient lives in its forward, llmctl.plan.memory.estimate)."""
        most = min(self._search(choice)[0], per_gpu)
        if most < per_gpu and choice.pp == 1 and self.whole_fits(choice, per_gpu):
            return per_gpu
        return most

    def whole_fits(self, choice: Choice, per_gpu: int) -> bool:
        """Whether the per-rank batch fits as one micro-batch, without accumulation (cached)."""
        key = (*choice.memory, per_gpu)
        if key not in self.wholes:
            req = self.req
            whole = replace(choice, compile=False, async_tp=False, micro_batch_size=per_gpu, grad_accum_steps=1)
            self.wholes[key] = mem.estimate(req.spec, whole.setup(req)).device_bytes <= req.capacity_bytes
        return self.wholes[key]

    def _search(self, choice: Choice) -> tuple[int, int]:
        """(largest micro-batch that fits up to the one-node per-rank batch, bytes per GPU at micro-batch 1).
        Memory depends neither on the per-rank batch nor, between SDPA and flash, on the kernel; full_shard's depends
        on the node count, and its search stops at that count's per-rank batch (what the planner asks)."""
        req = self.req
        n = choice.nodes if choice.strategy == "full_shard" else 1
        dp = max(1, n * req.gpus_per_node // (choice.tp * choice.cp * choice.pp))
        limit = max(1, req.global_batch // max(1, dp))
        key = (*choice.memory, limit)
        if key not in self.cache:
            # With accumulation (gradients live in the forward); max_mb adds the whole batch without it.
            one = self.need_estimate(choice)
            accum = probe_accum(choice)
            setup = replace(choice, compile=False, async_tp=False, micro_batch_size=1, grad_accum_steps=accum)
            setup = setup.setup(req)
            need, cap = one.device_bytes, req.capacity_bytes
            fitted = mem.max_micro_batch(req.spec, setup, cap, limit=limit, one=one) if need <= cap else 0
            self.cache[key] = (fitted, need)
        return self.cache[key]

    def micro_batches(self, choice: Choice, per_gpu: int, rejected: list[str]) -> list[int]:
        """The micro-batches to try (divisors of the per-rank batch that fit, or the pinned one), ascending; [] with
        the reason appended to `rejected` when none. `per_gpu`: sequences per data-parallel rank per step."""
        req, cap = self.req, self.req.capacity_bytes
        max_mb = self.max_mb(choice, per_gpu)
        on = choice.where()
        ckpt, chunk, tp, cp = choice.checkpointing, choice.loss_chunk_tokens, choice.tp, choice.cp
        ring = f", {choice.cp_rotate} ring" if cp > 1 else ""
        where = f"{on}, checkpointing {ckpt}, {choice.attention}{ring}{f', loss chunks of {chunk}' if chunk else ''}"
        if max_mb == 0:
            need = self._search(choice)[1]
            rejected.append(f"{where}: micro-batch 1 needs {need / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB")
            return []
        most = min(self._search(choice)[0], per_gpu)  # accumulating
        pinned = req.pin("micro_batch_size")
        if pinned is None:
            return [d for d in divisors(per_gpu) if d <= most or d == max_mb]
        if per_gpu % pinned:
            ranks = (
                f"{choice.nodes * req.gpus_per_node // (tp * cp)} data-parallel ranks"
                if tp * cp > 1
                else f"{choice.nodes * req.gpus_per_node} GPUs"
            )
            rejected.append(
                f"{on}: micro-batch {pinned} does not divide the {per_gpu} sequences per "
                f"{'data-parallel rank' if tp * cp > 1 else 'GPU'} (global batch {req.global_batch} over {ranks})"
            )
            return []
        if pinned > most and pinned != max_mb:
            at = replace(choice, compile=False, async_tp=False).at(pinned, per_gpu)
            need = mem.estimate(req.spec, at.setup(req))
            rejected.append(
                f"{where}: micro-batch {pinned} needs {need.device_bytes / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB"
            )
            return []
        return [pinned]


class Search:
    """One search of the planner over a space (llmctl.plan.space): each family (strategy, nodes, tp x cp, kernel) is
    searched for the Pareto front of checkpointing x loss chunk at the largest micro-batch that fits, timed, and its
    best kept under the search key (llmctl.spec.decisions.search_key). Families with TP are searched when their
    compute bound could beat the best so far, then families with CP when theirs (with the least recompute that fits,
    and the ring's exposed exchanges) could; the rest are `pruned` with their bound."""

    def __init__(self, req: PlanRequest, space: Space) -> None:
        self.req, self.space = req, space
        self.rejected = space.rejected
        self.memory = MemorySearch(req)
        self.best: dict[tuple, Candidate] = {}
        self.evaluated = 0
        self.top = 0.0  # the best candidate's sort key so far (its first figure)
        self.pruned: dict[tuple[int, int], float] = {}
        self.pp_pruned: dict[tuple[int, int], float] = {}  # (tp, pp) -> the bound of the PP families not searched
        self.ep_pruned: dict[int, float] = {}  # ep -> the bound of the EP families not searched (ep_bound)
        self.saturated: dict[tuple, int] = {}  # (tp, strategy, nodes, kernel) -> least cp whose cheapest option fit all
        pairs = list(itertools.product(space.checkpointing, sorted({0, *space.loss_chunks})))
        self.order = {
            a: sorted(
                pairs,
                key=lambda o, a=a: recompute_seconds(
                    req, req.candidate(checkpointing=o[0], attention=a, loss_chunk_tokens=o[1])
                ),
            )
            for a in space.attentions
        }
        """Per kernel: (checkpointing, loss chunk) options, cheapest recompute first."""

    def run(self) -> None:
        sp = self.space
        ring_pruned: dict[tuple[int, int], float] = {}
        if 1 in sp.pps:  # unless --pp pins a pipeline
            # Without TP or CP every data-parallel family is searched: the table compares them.
            for strategy in sp.strategies:
                for n in sp.usable.get((1, 1), []):
                    for attn in sp.attentions:
                        self.family(Choice(strategy, n, attention=attn))
            self._tp_families()
            ring_pruned = self._cp_families()
        self._pp_families()
        # What was pruned, against the best at the end of the search.
        self._say_pruned(self.pruned, "even without communication or recompute")
        self._say_pruned(ring_pruned, "with the least recompute that fits and no communication but the ring's", cp=True)
        metric = "tokens/s" if self.req.objective == "throughput" else "tokens/s per GPU"
        for ep, bound in self.ep_pruned.items():
            self.rejected.append(
                f"EP {ep} on some node counts: at most {bound:,.0f} {metric} with its all-to-alls (never hidden) and "
                f"no other communication or recompute, below the best {-self.top:,.0f}"
            )
        self.pruned.update(ring_pruned)

    def _tp_families(self) -> None:
        """With TP, a (tp, nodes, kernel) family is searched only if its compute alone (no communication, no
        recompute, the largest micro-batch) could beat the best setup so far: most node counts of a large cluster
        cannot."""
        sp, comp = self.space, max(self.space.compiles)
        bounds = sorted(
            (
                (parallel_bound(self.req, Choice("full_shard", n, tp, 1, attention=a, compile=comp)), tp, n, a)
                for tp, cp in sp.degrees
                if tp > 1 and cp == 1
                for n in sp.usable[(tp, cp)]
                for a in sp.attentions
            ),
            key=lambda b: -b[0],
        )
        for bound, tp, n, attn in bounds:
            if self.best and bound < -self.top:
                self.pruned[(tp, 1)] = max(self.pruned.get((tp, 1), 0.0), bound)
                continue
            for strategy in sp.strategies:
                self.family(Choice(strategy, n, tp, 1, attention=attn))

    def _splits(self, pp: int) -> list[tuple[str, int | None]]:
        """The searched (schedule, stages per rank) whose pp x v stages the model's layers split into (rule "pp
        split")."""
        most = max_stages(self.req.spec.num_layers)
        return [
            (s, v) for s, v in self.space.schedules if pp * (v or pipeline.schedule(s).default_virtual_stages()) <= most
        ]

    def _pp_families(self) -> None:
        """With PP (cp 1), after the families without it: a (tp, pp, nodes, kernel) family is searched only if its
        bound (`pipeline_bound`: an even 1/pp of the compute, no recompute or communication, the least bubble of the
        schedules searched) could beat the best so far; then each schedule x stages per rank the model's layers
        split into, each strategy. The pruned are said in `rejected` with their bound."""
        sp, req, comp = self.space, self.req, max(self.space.compiles)
        if not sp.schedules:
            return
        times: dict[tuple, tuple[float, float]] = {}
        bounds = sorted(
            (
                (bound, tp, pp, n, a, sched)
                for (tp, pp), nodes in sp.pp_usable.items()
                for n in nodes
                for a in sp.attentions
                for sched, bound in pipeline_bound(
                    req, self._fastest(n, tp, 1, a, comp, pp), self._splits(pp), times
                ).items()
            ),
            key=lambda b: -b[0],
        )
        for bound, tp, pp, n, attn, (sched, v) in bounds:
            if self.best and bound < -self.top:
                self.pp_pruned[(tp, pp)] = max(self.pp_pruned.get((tp, pp), 0.0), bound)
                continue
            for strategy in sp.strategies:
                f = Choice(strategy, n, tp, attention=attn, pp=pp, pp_schedule=sched, pp_virtual_stages=v)
                self.family(replace(f, pp_microbatches=req.pin("pp_microbatches")))
        metric = "tokens/s" if req.objective == "throughput" else "tokens/s per GPU"
        for (tp, pp), bound in self.pp_pruned.items():
            what = f"PP {pp}" + (f" x TP {tp}" if tp > 1 else "")
            self.rejected.append(
                f"{what} on some node counts: at most {bound:,.0f} {metric} even without communication or recompute "
                f"and with the least bubble, below the best {-self.top:,.0f}"
            )

    def _cp_families(self) -> dict[tuple[int, int], float]:
        """With CP, after every family without it: ring attention runs on SDPA, and a family is searched only if its
        compute at the largest micro-batch with the least recompute that lets micro-batch 1 fit, plus its ring's
        exposed exchanges (`MemorySearch.ring_bound`), could beat the best setup so far."""
        sp, comp = self.space, max(self.space.compiles)
        sdpa = Attention.SDPA
        bounds = sorted(
            (
                (
                    self.memory.ring_bound(
                        self._fastest(n, tp, cp), sp.strategies, self.order[sdpa], sp.loss_chunks, comp, sp.eps
                    ),
                    tp,
                    cp,
                    n,
                )
                for tp, cp in sp.degrees
                if cp > 1 and sdpa in sp.attentions
                for n in sp.usable[(tp, cp)]
            ),
            key=lambda b: -b[0],
        )
        ring_pruned: dict[tuple[int, int], float] = {}
        for bound, tp, cp, n in bounds:
            if self.best and bound < -self.top:
                ring_pruned[(tp, cp)] = max(ring_pruned.get((tp, cp), 0.0), bound)
                continue
            for strategy in sp.strategies:
                self.family(Choice(strategy, n, tp, cp, attention=sdpa))
        return ring_pruned

    def _fastest(
        self, n: int, tp: int, cp: int, attention: str = "sdpa", compile_: bool = False, pp: int = 1
    ) -> Choice:
        """A full_shard family at the largest expert-parallel degree it takes (llmctl.plan.space.largest_ep: 1 for a
        dense model), what the bounds read: full_shard borrows from the most ranks, and a larger ep only speeds the
        compute (grouped GEMMs, fewer FSDP copies) and shrinks the memory."""
        f = Choice("full_shard", n, tp, cp, attention=attention, compile=compile_, pp=pp)
        return replace(f, ep=largest_ep(self.req, f, self.space.eps))

    def _say_pruned(self, pruned: dict[tuple[int, int], float], how: str, cp: bool = False) -> None:
        metric = "tokens/s" if self.req.objective == "throughput" else "tokens/s per GPU"
        for (tp, c), bound in pruned.items():
            parts = (("CP", c), ("TP", tp)) if cp else (("TP", tp), ("CP", c))
            what = " x ".join(f"{k} {v}" for k, v in parts if v > 1)
            self.rejected.append(
                f"{what} on some node counts: at most {bound:,.0f} {metric} {how}, below the best {-self.top:,.0f}"
            )

    def family(self, f: Choice) -> None:
        """Search one (tp, cp, strategy, nodes, kernel) family at each expert-parallel degree it takes
        (llmctl.plan.space.family_eps; ep 1 alone for a dense model)."""
        for ep in family_eps(self.req, f, self.space.eps, self.rejected):
            self._family(replace(f, ep=ep))

    def _family(self, f: Choice) -> None:
        """Search one (tp, cp, strategy, nodes, kernel, ep) family: the Pareto front of checkpointing x loss chunk.
        Cheapest recompute first, an option is worth its memory search and timing only if it fits a larger
        micro-batch than every cheaper one (at an equal micro-batch the cheaper recompute is faster, at every
        micro-batch, since both scale with its tokens); once one fits the whole per-rank batch, nothing dearer can
        win. Thousands of dominated setups are never searched or timed."""
        req, g = self.req, self.req.gpus_per_node
        if f.strategy == "hybrid_shard" and (f.nodes < 2 or g % (f.tp * f.cp) or g // (f.tp * f.cp) < 2):
            return  # one node, or a shard group of one rank: that is full_shard, or no_shard
        dp = dp_ranks(req, f.nodes, f.tp, f.cp, f.pp)
        if f.strategy == "hybrid_shard" and (dp % (g // (f.tp * f.cp)) or dp // (g // (f.tp * f.cp)) < 2):
            return  # under pp a node's shard group holds all of a stage's data-parallel ranks: no replicas
        if req.pin("offload") and (problem := self.memory.host_problem(f)):
            self.rejected.append(problem)  # CPU offload's states do not fit the host's memory: no micro-batch helps
            return
        if f.ep > 1 and f.pp == 1 and self.best:  # its compute and all-to-alls alone cannot win: not searched
            bound = ep_bound(req, f)
            if bound < -self.top:
                self.ep_pruned[f.ep] = max(self.ep_pruned.get(f.ep, 0.0), bound)
                return
        fam = (f.tp, f.strategy, f.nodes, f.attention, f.pp, f.pp_schedule, f.pp_virtual_stages, f.ep)
        if self.saturated.get(fam, f.cp) < f.cp:
            # A smaller cp ran the whole per-rank batch in one micro-batch without recompute: a larger one runs the
            # same tokens per GPU in GEMMs as large at best, and its ring only adds communication.
            return
        per_rank = req.global_batch // dp
        top = req.pin("micro_batch_size") or per_rank  # the largest micro-batch worth fitting
        # Ring attention: the all-to-all rotation never holds more than the all-gather's buffers
        # (llmctl.plan.memory.ring), so its memory search stands for both; the all-gather is timed beside it where it
        # fits (equal predictions keep it: torch's and torchtitan's default).
        f = replace(f, cp_rotate="alltoall" if f.cp > 1 else "allgather")
        largest = 0
        # (TP computes the loss on vocabulary shards, loss parallel: unchunked.)
        options = [o for o in self.order[f.attention] if (o[1] == 0 if f.tp > 1 else o[1] in self.space.loss_chunks)]
        if f.pp > 1 and not self._pipeline_fits(f, options):
            return
        for k, (ckpt, chunk) in enumerate(options):
            if largest >= top:
                break
            option = replace(f, checkpointing=ckpt, loss_chunk_tokens=chunk)
            mbs = self.memory.micro_batches(option, per_rank, self.rejected)
            if k == 0 and mbs and mbs[-1] >= top:  # the cheapest option runs the whole batch at once
                self.saturated[fam] = min(f.cp, self.saturated.get(fam, f.cp))
            # At an equal micro-batch the order by recompute (priced at mb 1, without compile) can disagree with
            # the timed step (memory-bound recompute does not scale with the GEMM efficiency): time both.
            if not mbs or mbs[-1] < largest:
                continue
            if f.pp > 1:  # the bubble falls with more, smaller micro-batches: every one that fits is timed
                runs = [c for c in (self._pipeline_run(option, m, per_rank) for m in mbs if m > largest) if c]
                for c in runs:
                    self._time(c)
                if not runs and f.pp_microbatches and largest == 0:
                    self.rejected.append(
                        f"{f.where()}: --pp-microbatches {f.pp_microbatches} divides the accumulation of no "
                        f"micro-batch that fits ({', '.join(map(str, mbs))} of {per_rank} sequences per rank)"
                    )
                largest = mbs[-1]
                continue
            largest = mbs[-1]
            # Only the largest micro-batch that fits is timed: a step's compute time falls with the micro-batch
            # (the GEMM-shape efficiency rises with the tokens per micro-batch) and so does its communication
            # (fewer micro-batches, each hiding more behind longer compute).
            self._time(option.at(largest, per_rank))

    def _pipeline_fits(self, f: Choice, options: list[tuple[str, int]]) -> bool:
        """Whether a pp family's least memory fits micro-batch 1: full checkpointing with the most chunked loss keeps
        the least of every option (each other mode keeps more of a block, an unchunked loss all its logits). When it
        does not, the family is dropped in one line before the memory search of each option."""
        least = [o for o in options if o[0] == "full"]
        if not least:
            return True
        ckpt, chunk = max(least, key=lambda o: o[1])
        need = self.memory.need(replace(f, checkpointing=ckpt, loss_chunk_tokens=chunk))
        cap = self.req.capacity_bytes
        if need <= cap:
            return True
        self.rejected.append(
            f"{f.where()}: micro-batch 1 needs {need / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB even with full "
            "checkpointing"
        )
        return False

    def _pipeline_run(self, f: Choice, mb: int, per_rank: int) -> Choice | None:
        """The choice at micro-batch `mb` with the most micro-batches a schedule run that fits the GPU (all of the
        step's first: the least bubble and the fewest FSDP gathers; fewer a run hold fewer in flight and fewer
        receive buffers, llmctl.plan.memory), or the pinned count; None when none fits or runs. A run's count
        divides the accumulation (rule "pp microbatches"), and a looped schedule has at least pp micro-batches a run
        (torch's interleaved schedules need them to fill the loop; the bubble formulas assume them)."""
        req, accum = self.req, per_rank // mb
        pinned = f.pp_microbatches
        looped = pipeline.schedule(f.pp_schedule).looped
        for m in [pinned] if pinned else sorted(divisors(accum), reverse=True):
            if accum % m:
                continue
            if looped and m < f.pp:
                break
            c = replace(f, pp_microbatches=m if pinned or m < accum else None).at(mb, per_rank)
            if mem.estimate(req.spec, c.setup(req)).device_bytes <= req.capacity_bytes:
                return c
        return None

    def _time(self, c: Choice) -> None:
        """Time a choice at its micro-batch: each compile choice without CP or PP; with them only the faster (compile only
        ever speeds a step up in this model: COMPILE_SPEEDUP, and async TP), and the all-gather rotation where it fits
        and its ring hides as much as the all-to-all's (equal predictions keep it: torch's and torchtitan's
        default)."""
        req = self.req
        if c.cp == 1 and c.pp == 1:
            for comp in self.space.compiles:
                # async TP only hides communication
                self.keep(
                    evaluate(req, replace(c, compile=comp, async_tp=c.tp > 1 and comp and req.async_tp).setup(req))
                )
            return
        comp = max(self.space.compiles)
        setup = replace(c, compile=comp, async_tp=c.tp > 1 and comp and req.async_tp).setup(req)
        timed = evaluate(req, setup)
        if c.cp == 1:  # PP: no ring rotation to choose
            self.keep(timed)
            return
        gathered = replace(setup, cp_rotate="allgather")
        if (
            cp_comm(req, gathered, timed.predicted.efficiency).exposed_s <= timed.predicted.cp_comm_exposed_s
            and mem.estimate(req.spec, mem.memory_key(gathered)).device_bytes <= req.capacity_bytes
        ):
            timed = evaluate(req, gathered)
        self.keep(timed)

    def keep(self, c: Candidate) -> None:
        """Count a timed setup and keep it if it is its family's best so far."""
        self.evaluated += 1
        key = search_key(c.setup)
        if key not in self.best or sort_key(self.req, c) < sort_key(self.req, self.best[key]):
            self.best[key] = c
        self.top = min(self.top, sort_key(self.req, c)[0])
