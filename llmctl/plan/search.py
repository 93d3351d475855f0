"""The planner's memory search: the largest micro-batch that fits each setup of the search (memory.max_micro_batch),
cached across the strategies and node counts that share it, the micro-batches worth timing, and the bound that lets the
planner skip a context-parallel family that cannot win (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llmctl.plan import kernel_time
from llmctl.plan import memory as mem
from llmctl.plan import offload as ol
from llmctl.plan.explain import sort_key
from llmctl.plan.request import PlanRequest
from llmctl.plan.request import node_counts as node_counts  # re-exported (the planner, llmctl.tune)
from llmctl.plan.timing import Candidate, compute_times, cp_comm, evaluate
from llmctl.spec.hardware import GIB
from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import CP_ROTATES, TrainSetup


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def parallel_bound(req: PlanRequest, tp: int, cp: int, nodes: int, attn: str, compile_: bool) -> float:
    """An upper bound on what a tp x cp > 1 family on `nodes` nodes predicts (tokens/s, or per GPU for the cost
    objective): its compute alone at the largest micro-batch (the GEMM efficiency only grows with it), without
    recompute or communication (both only add time)."""
    g = req.gpus_per_node
    per_rank = req.global_batch // (nodes * g // (tp * cp))
    mb = req.micro_batch or per_rank
    setup = req.setup("full_shard", nodes, mb, max(1, per_rank // mb), "none", attn, compile_, 0, tp, cp=cp)
    _, fwd, bwd = compute_times(req, setup)
    tps = setup.tokens_per_step / (setup.grad_accum_steps * (fwd + bwd))
    return tps if req.objective == "throughput" else tps / setup.gpus


def tp_bound(req: PlanRequest, tp: int, nodes: int, attn: str, compile_: bool) -> float:
    """parallel_bound without context parallelism."""
    return parallel_bound(req, tp, 1, nodes, attn, compile_)


@dataclass(frozen=True)
class OffloadFamily:
    """One (tp, cp, strategy, nodes) family of the search with the kernel and loss chunk of its fastest setup."""

    tp: int
    cp: int
    strategy: str
    nodes: int
    attention: str
    loss_chunk_tokens: int


def offload_can_win(req: PlanRequest, best: Candidate, families: list[OffloadFamily]) -> bool:
    """Whether some CPU-offload setup could beat `best`, the best setup without offload. An offload setup takes at
    least as long as the same setup without it plus the host's optimizer step (llmctl.plan.offload: its copies and
    host work only add time), and that setup at best as long as its family's fastest: the whole per-rank batch
    without recompute, compiled (the search's own rule: a larger micro-batch and less recompute are faster). Where
    that fastest setup fits the GPUs without offload, the first search had it (or pruned its family as slower) and
    offload adds time to it; elsewhere its step plus the host step bounds the family. Cheapest tests first: the
    compute alone, then the memory, then the whole step."""
    target = -sort_key(req, best)[0]
    compiles = [req.compile] if req.compile is not None else [True]  # compile fuses memory-bound ops: never slower
    ckpt = req.checkpointing or "none"
    search = MemorySearch(replace(req, offload=True))
    for f in families:
        per_rank = req.global_batch // (f.nodes * req.gpus_per_node // (f.tp * f.cp))
        mb = req.micro_batch or per_rank
        async_tp = f.tp > 1 and compiles[0] and req.async_tp
        setup = req.setup(f.strategy, f.nodes, mb, max(1, per_rank // mb), ckpt, f.attention, compiles[0])
        setup = replace(setup, loss_chunk_tokens=f.loss_chunk_tokens, tp=f.tp, async_tp=async_tp, cp=f.cp)
        host = ol.offload_time(req.gpu, req.spec, replace(setup, levers=ol.ON), 0.0, 0.0, [], 1.0).optimizer_s
        _, fwd, bwd = compute_times(req, setup)
        if _metric(req, setup, setup.grad_accum_steps * (fwd + bwd) + host) <= target:
            continue
        if mem.estimate(req.spec, mem.memory_key(setup)).device_bytes <= req.capacity_bytes:
            continue  # fits without offload: searched as it is
        if search.host_problem(f.strategy, f.nodes, f.tp, f.cp):
            continue  # the host cannot hold its states
        # the GPU's own optimizer step, which offload moves to the host, leaves the bound
        gpu_step = kernel_time.optimizer_seconds(req.gpu, req.spec, setup) / req.efficiency.calibration
        if _metric(req, setup, evaluate(req, setup).predicted.step_time_s - gpu_step + host) > target:
            return True
    return False


def _metric(req: PlanRequest, setup: TrainSetup, step_s: float) -> float:
    """What the objective ranks by for a step of `step_s`: tokens/s, or tokens/s per GPU (cost)."""
    tps = setup.tokens_per_step / step_s
    return tps if req.objective == "throughput" else tps / setup.gpus


def family_key(strategy: str, n: int, ckpt: str, attn: str, chunk: int, tp: int, cp: int, rotate: str) -> tuple:
    """What a family's memory depends on: a full_shard's node count (the others' on one or two), and between SDPA and
    flash not the kernel (MemorySearch's caches)."""
    kernel = "eager" if attn == "eager" else "fused"
    return (tp, cp, rotate, strategy, n if strategy == "full_shard" else min(n, 2), ckpt, kernel, chunk)


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
        bool(req.offload),
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

    def host_problem(self, strategy: str, n: int, tp: int = 1, cp: int = 1) -> str | None:
        """Under CPU offload, why a family's states do not fit the host's memory per node (None: they fit, or the
        node's memory is not known). They depend on the shard degree only: not on the micro-batch, checkpointing or
        kernel (cached; a full_shard's on its node count, the others' on one or two)."""
        req, cap = self.req, self.req.host_capacity_bytes
        key = (tp, cp, strategy, n if strategy == "full_shard" else min(n, 2))
        if cap is None:
            return None
        if key not in self.hosts:
            est = mem.estimate(req.spec, req.setup(strategy, n, 1, 1, "full", "sdpa", False, 0, tp, cp=cp))
            self.hosts[key] = None
            if est.host_bytes > cap:
                g = req.gpus_per_node
                par = "".join(f" x {k} {v}" for k, v in (("CP", cp), ("TP", tp)) if v > 1)
                where = (
                    f"the cluster's node_memory_gib {req.node_memory_gib:g}"
                    if req.node_memory_gib is not None
                    else f"{req.gpu.name}'s node in the GPU catalog: {req.gpu.node_memory_gib_per_gpu} GiB per GPU"
                )
                self.hosts[key] = (
                    f"{strategy}{par} on {n} node{'s' if n > 1 else ''} with CPU offload: host memory "
                    f"{est.host_node_bytes / GIB:,.0f} GiB per node ({est.host_bytes / GIB:.1f} GiB per GPU: "
                    f"parameters, gradients and optimizer states) > {cap * g / GIB:,.0f} GiB ({where})"
                )
        return self.hosts[key]

    def need(self, *family: Any, **kw: Any) -> int:
        """Bytes per GPU at micro-batch 1: need_estimate's device bytes (the same arguments)."""
        return self.need_estimate(*family, **kw).device_bytes

    def need_estimate(
        self,
        strategy: str,
        n: int,
        ckpt: str,
        attn: str,
        chunk: int,
        tp: int = 1,
        cp: int = 1,
        rotate: str = "allgather",
        accumulating: bool = True,
    ) -> mem.MemoryEstimate:
        """The estimate at micro-batch 1 (cached; a full_shard's on its node count, the others' on one or two), with
        gradient accumulation (the gradients live in the forward) unless `accumulating` is False; max_micro_batch
        starts from it."""
        key = (*family_key(strategy, n, ckpt, attn, chunk, tp, cp, rotate), accumulating)
        if key not in self.needs:
            acc = 2 if accumulating else 1
            setup = self.req.setup(strategy, n, 1, acc, ckpt, attn, False, chunk, tp, cp=cp, cp_rotate=rotate)
            self.needs[key] = mem.estimate(self.req.spec, setup)
        return self.needs[key]

    def ring_bound(
        self,
        tp: int,
        cp: int,
        n: int,
        strategies: list[str],
        options: list[tuple[str, int]],
        chunks: list[int],
        compile_: bool,
    ) -> float:
        """An upper bound on what a cp > 1 family on `n` nodes predicts (tokens/s, or per GPU for the cost objective):
        the options (checkpointing x loss chunk, cheapest recompute first) before the first that fits micro-batch 1
        with some strategy cannot run; every setup of the family runs one of the rest, at most at the largest
        micro-batch, and takes at least its compute time there plus its ring's exposed exchanges (FSDP's and TP's
        communication only add). Infinite when none fits (the family's search then says why)."""
        req, g = self.req, self.req.gpus_per_node
        allowed = [o for o in options if (o[1] == 0 if tp > 1 else o[1] in chunks)]
        strats = [st for st in strategies if st != "hybrid_shard" or (n > 1 and g % (tp * cp) == 0)]

        def fits(ckpt: str, chunk: int) -> bool:
            cap = req.capacity_bytes  # an upper bound: micro-batch 1 with no accumulation, the least memory
            return any(self.need(st, n, ckpt, "sdpa", chunk, tp, cp, "alltoall", False) <= cap for st in strats)

        first = next((i for i, o in enumerate(allowed) if fits(*o)), None)
        if first is None:
            return float("inf")  # nothing fits: searched, so that its reasons are recorded
        per_rank = req.global_batch // (n * g // (tp * cp))
        mb = req.micro_batch or per_rank
        least = float("inf")  # the least compute time per step of the options that can run
        for ckpt, chunk in allowed[first:]:
            setup = req.setup("full_shard", n, mb, max(1, per_rank // mb), ckpt, "sdpa", compile_, chunk, tp, cp=cp)
            eff, fwd, bwd = compute_times(req, setup)
            least = min(least, setup.grad_accum_steps * (fwd + bwd))
        # The ring's exposure without recompute (which only runs the forward ring again), at the largest micro-batch
        # (the fewest steps: least latency per token), by the rotation that hides more.
        flat = replace(setup, checkpointing="none")
        ring = min(cp_comm(req, replace(flat, cp_rotate=r), eff).exposed_s for r in CP_ROTATES)
        tps = setup.tokens_per_step / (least + ring)
        return tps if req.objective == "throughput" else tps / setup.gpus

    def max_mb(
        self,
        strategy: str,
        n: int,
        ckpt: str,
        attn: str,
        chunk: int,
        per_gpu: int,
        tp: int = 1,
        cp: int = 1,
        rotate: str = "allgather",
    ) -> int:
        """The largest micro-batch to try: the largest that fits with accumulation, or the whole per-rank batch when
        it fits as one micro-batch (no accumulation: no gradient lives in its forward, llmctl.plan.memory.estimate)."""
        most = min(self._search(strategy, n, ckpt, attn, chunk, tp, cp, rotate)[0], per_gpu)
        if most < per_gpu and self.whole_fits(strategy, n, ckpt, attn, chunk, per_gpu, tp, cp, rotate):
            return per_gpu
        return most

    def whole_fits(
        self,
        strategy: str,
        n: int,
        ckpt: str,
        attn: str,
        chunk: int,
        per_gpu: int,
        tp: int = 1,
        cp: int = 1,
        rotate: str = "allgather",
    ) -> bool:
        """Whether the per-rank batch fits as one micro-batch, without accumulation (cached)."""
        key = (*family_key(strategy, n, ckpt, attn, chunk, tp, cp, rotate), per_gpu)
        if key not in self.wholes:
            req = self.req
            setup = req.setup(strategy, n, per_gpu, 1, ckpt, attn, False, chunk, tp, cp=cp, cp_rotate=rotate)
            self.wholes[key] = mem.estimate(req.spec, setup).device_bytes <= req.capacity_bytes
        return self.wholes[key]

    def _search(
        self,
        strategy: str,
        n: int,
        ckpt: str,
        attn: str,
        chunk: int,
        tp: int = 1,
        cp: int = 1,
        rotate: str = "allgather",
    ) -> tuple[int, int]:
        """(largest micro-batch that fits up to the one-node per-rank batch, bytes per GPU at micro-batch 1).
        Memory depends neither on the per-rank batch nor, between SDPA and flash, on the kernel; full_shard's depends
        on the node count, and its search stops at that count's per-rank batch (what the planner asks)."""
        req = self.req
        dp = (n if strategy == "full_shard" else 1) * req.gpus_per_node // (tp * cp)
        limit = max(1, req.global_batch // max(1, dp))
        key = (*family_key(strategy, n, ckpt, attn, chunk, tp, cp, rotate), limit)
        if key not in self.cache:
            # With accumulation (gradients live in the forward); max_mb adds the whole batch without it.
            setup = req.setup(strategy, n, 1, 2, ckpt, attn, False, chunk, tp, cp=cp, cp_rotate=rotate)
            one = self.need_estimate(strategy, n, ckpt, attn, chunk, tp, cp, rotate)
            need = one.device_bytes
            cap = req.capacity_bytes
            fitted = mem.max_micro_batch(req.spec, setup, cap, limit=limit, one=one) if need <= cap else 0
            self.cache[key] = (fitted, need)
        return self.cache[key]

    def micro_batches(
        self,
        strategy: str,
        n: int,
        ckpt: str,
        attn: str,
        chunk: int,
        per_gpu: int,
        rejected: list[str],
        tp: int = 1,
        cp: int = 1,
        rotate: str = "allgather",
    ) -> list[int]:
        """The micro-batches to try (divisors of the per-rank batch that fit, or the pinned one), ascending; [] with
        the reason appended to `rejected` when none. `per_gpu`: sequences per data-parallel rank per step."""
        req, cap = self.req, self.req.capacity_bytes
        max_mb = self.max_mb(strategy, n, ckpt, attn, chunk, per_gpu, tp, cp, rotate)
        par = "".join(f" x {k} {v}" for k, v in (("CP", cp), ("TP", tp)) if v > 1)
        on = f"{strategy}{par} on {n} node{'s' if n > 1 else ''}"
        ring = f", {rotate} ring" if cp > 1 else ""
        where = f"{on}, checkpointing {ckpt}, {attn}{ring}{f', loss chunks of {chunk}' if chunk else ''}"
        if max_mb == 0:
            need = self._search(strategy, n, ckpt, attn, chunk, tp, cp, rotate)[1]
            rejected.append(f"{where}: micro-batch 1 needs {need / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB")
            return []
        most = min(self._search(strategy, n, ckpt, attn, chunk, tp, cp, rotate)[0], per_gpu)  # accumulating
        if req.micro_batch is None:
            return [d for d in divisors(per_gpu) if d <= most or d == max_mb]
        if per_gpu % req.micro_batch:
            ranks = (
                f"{n * req.gpus_per_node // (tp * cp)} data-parallel ranks"
                if tp * cp > 1
                else f"{n * req.gpus_per_node} GPUs"
            )
            rejected.append(
                f"{on}: micro-batch {req.micro_batch} does not divide the {per_gpu} sequences per "
                f"{'data-parallel rank' if tp * cp > 1 else 'GPU'} (global batch {req.global_batch} over {ranks})"
            )
            return []
        if req.micro_batch > most and req.micro_batch != max_mb:
            acc = per_gpu // req.micro_batch
            pinned = req.setup(strategy, n, req.micro_batch, acc, ckpt, attn, False, chunk, tp, cp=cp, cp_rotate=rotate)
            need = mem.estimate(req.spec, pinned)
            rejected.append(
                f"{where}: micro-batch {req.micro_batch} needs {need.device_bytes / GIB:.1f} GiB per GPU > "
                f"{cap / GIB:.1f} GiB"
            )
            return []
        return [req.micro_batch]
