"""The planner: enumerate setups, drop what does not fit, time the rest, rank, explain (torch-free).

Search space: tensor-parallel degree (llmctl.families.tensor_parallel.valid_tp: 1, 2, 4, 8 inside a node, where the
model's family has a plan and the degree divides its heads, kv heads and MLP width) x context-parallel degree (1, 2,
4, ... up to the cluster where the model's attention runs as ring attention, llmctl.families.context_parallel, and
2cp x tp splits the sequence; ring attention on SDPA, the head-tail load balance, its all-gather or all-to-all
rotation) x strategy (full_shard,
hybrid_shard, no_shard: what the engine runs, over the data-parallel ranks) x nodes used (powers of two and divisors
of the cluster's node count: on a slow network fewer nodes can win) x micro-batch (per data-parallel rank: a tp group
shares one; divisors of the per-rank batch, up to memory.max_micro_batch) x gradient accumulation (the global batch
is held fixed: micro_batch x accumulation x data-parallel ranks = global batch) x checkpointing x attention kernel x
compile (with tp > 1, compile on a CUDA GPU turns on async TP: it only hides communication) x loss chunk (0 with
tp > 1: TP computes the loss on vocabulary shards; past LONG_CONTEXT_TOKENS only the chunked loss).

Families with TP are searched when their compute bound could beat the best so far, then families with CP when theirs
(with the least recompute that fits, and the ring's exposed exchanges: llmctl.plan.search.MemorySearch.ring_bound)
could; the setups without CP are searched exactly as without it.

CPU offload (FSDP2's CPUOffloadPolicy): pinned (--offload, --no-offload) every setup searched has it or none has.
Unpinned the search runs without it, then once more with it only where nothing fits without it, or where some
family could win with it (llmctl.plan.search.offload_can_win: its fastest setup, the whole batch without recompute,
does not fit without offload, and that setup's step plus the host's optimizer step, which nothing hides, beats the
best setup without it). Offload frees the GPU of the states, so it can win where they squeeze a setup into recompute,
small micro-batches or TP; its copies and host step only add time to a setup that fits as it is. The faster search
wins and the explanation says why. Under offload a family whose states do not fit the host's memory per node (the
cluster file's node_memory_gib, else the GPU catalog's) is dropped before its memory search. What fits comes from
llmctl.plan.memory, what it costs from llmctl.plan.timing; the request is llmctl.plan.request, the explanations
llmctl.plan.explain, the plan file llmctl.plan.emit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

from llmctl.errors import DoesNotFitError, InputError
from llmctl.families.context_parallel import cp_problem
from llmctl.families.tensor_parallel import valid_tp
from llmctl.plan import float8 as f8
from llmctl.plan import memory as mem
from llmctl.plan.calibrate import Calibration
from llmctl.plan.explain import (
    explain_cp_choice,
    explain_memory_choice,
    explain_offload,
    explain_precision,
    explain_tp_choice,
    offload_won,
    recompute_seconds,
    sort_key,
    why_lost,
)
from llmctl.plan.explain_finetune import explain_finetune
from llmctl.plan.explain_kernels import efficiency_basis, step_split
from llmctl.plan.request import TIGHT_MEMORY_FRACTION, PlanRequest
from llmctl.plan.search import MemorySearch, OffloadFamily, offload_can_win, parallel_bound
from llmctl.plan.search import divisors as divisors  # re-exported (llmctl.tune.space)
from llmctl.plan.search import tp_bound as tp_bound  # re-exported
from llmctl.plan.timing import Candidate, cp_comm, evaluate
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.hardware import GIB
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import ENGINE_STRATEGIES, sequence_split_problem
from llmctl.spec.setup import ATTENTIONS, TrainSetup

# Chunked loss: one chunk's logits are about 2^26 elements (512 MiB for the fp32 log-softmax and its gradient in
# backward): 512 tokens for Llama 3's 128k vocabulary, 2048 for Llama 2's 32k; never below 256 tokens (smaller
# GEMMs lose efficiency) nor above 8192.
LOSS_CHUNK_ELEMENTS = 2**26
LONG_CONTEXT_TOKENS = 32768
"""Past this sequence length the planner keeps the loss chunked (tp = 1): the whole logits of one 32k-token sequence
over Llama 3's 128k vocabulary are 7.8 GiB in bf16, 15.7 GiB upcast to fp32 and 15.7 GiB more for the fp32
log-softmax."""


@dataclass(frozen=True)
class PlanResult:
    request: PlanRequest
    chosen: Candidate
    candidates: list[Candidate]
    """Ranked best first; the best setup of each (tp, cp or not, strategy, nodes used, recompute or not) family: the
    alternatives a person weighs (the modes, cp degrees, kernel, loss and compile variants of one family are in
    `variants`; `memory_choice` compares the checkpointing modes of the chosen strategy)."""
    why_lost: dict[int, str]
    """Index into candidates -> one sentence."""
    variants: list[Candidate]
    """Every (tp, strategy, nodes, checkpointing, attention, compile, loss chunk) at its best micro-batch, ranked."""
    rejected: list[str]
    """Why whole families were dropped (does not fit, pins, batch does not split)."""
    evaluated: int
    memory_choice: str = ""
    """Why this checkpointing and loss: what the other modes would fit and cost on the same strategy and nodes."""
    tp_choice: str = ""
    """Why tensor parallelism won or lost: memory freed, share of the step in TP collectives, against the best other."""
    cp_choice: str = ""
    """Why context parallelism was used or not: what one sequence's activations need without it, what the ring costs."""
    precision_choice: str = ""
    """What --precision auto chose on a GPU without bf16 and why; under float8, what runs on its tensor cores."""
    step_split: str = ""  # the chosen step by kind of kernel, with each rate's basis (llmctl.plan.explain_kernels)
    finetune_choice: str = ""  # with adapters: full, LoRA and QLoRA compared here (llmctl.plan.explain_finetune)
    offload_choice: str = ""  # under CPU offload: why it is on, what GPU and host hold, what it costs (else empty)

    def memory_margin(self) -> dict[str, Any]:
        """The chosen setup's memory against the GPU's: what the prediction holds beyond the allocations (allocator
        headroom, CUDA context), the margin asked for, what is left free, and a warning when that is under
        request.TIGHT_MEMORY_FRACTION of the GPU without a margin asked for."""
        req, s = self.request, self.chosen.setup
        est = mem.estimate(req.spec, s)
        total = req.gpu.memory_bytes
        free = total - est.device_bytes
        out: dict[str, Any] = {
            "gpu_bytes": total,
            "predicted_bytes": est.device_bytes,
            "allocator_headroom_bytes": est.headroom_bytes,
            "headroom_fraction": s.headroom_fraction,
            "cuda_context_bytes": s.cuda_context_bytes,
            "margin_fraction": req.memory_margin,
            "free_bytes": free,
            "free_fraction": free / total,
            "warning": None,
        }
        if req.memory_margin == 0 and free < TIGHT_MEMORY_FRACTION * total:
            out["warning"] = (
                f"the chosen setup leaves {free / GIB:.1f} GiB ({free / total:.1%}) of the {total / GIB:.1f} GiB free, "
                f"under {TIGHT_MEMORY_FRACTION:.0%}: a CUDA or NCCL stack with larger workspaces than assumed, or "
                f"fragmentation beyond the {s.headroom_fraction:.0%} headroom, would run out of memory; "
                f"--memory-margin {TIGHT_MEMORY_FRACTION:g} plans with that much kept free"
            )
        return out

    def as_dict(self, top: int, calibration: Calibration | None = None) -> dict[str, Any]:
        """What `llmctl plan --json` prints (the top candidates, and the calibration the request used)."""
        req, cal, result = self.request, calibration, self
        spec, gpu_spec, network = req.spec, req.gpu, req.network

        return {
            "model": spec.name,
            "params": spec.params,
            "active_params_per_token": spec.active_params_per_token,
            "measured": spec.measured is not None,
            "gpu": gpu_spec.name,
            "nodes": req.nodes,
            "gpus_per_node": req.gpus_per_node,
            "seq_len": req.seq_len,
            "global_batch_seqs": req.global_batch,
            "objective": req.objective,
            "network": {
                "source": network.source,
                "intra_busbw_gbytes_s": network.intra_gbytes_s,
                "inter_node_gbytes_s": network.inter_node_gbytes_s,
            },
            "overlap": req.overlap,
            "efficiency": efficiency_basis(req),
            "calibration": None
            if cal is None
            else {
                "factor": cal.factor,
                "steps": cal.steps,
                "measured_tokens_per_s": cal.measured_tokens_per_s,
                "predicted_tokens_per_s": cal.predicted_tokens_per_s,
                "method": cal.method,
            },
            "evaluated": result.evaluated,
            "chosen": result.chosen.as_dict(),
            "candidates": [c.as_dict() for c in result.candidates[:top]],
            "variants_considered": len(result.variants),
            "why_lost": [result.why_lost[i] for i in range(1, min(top, len(result.candidates)))],
            "memory_choice": result.memory_choice,
            "step_split": result.step_split,
            "tp_choice": result.tp_choice,
            "cp_choice": result.cp_choice,
            "precision": req.precision.name,
            "precision_choice": result.precision_choice,
            # Only when a setup offloads, so that the answers without it stay as they were.
            **({"offload_choice": result.offload_choice} if result.offload_choice else {}),
            **({"finetune_choice": result.finetune_choice} if result.finetune_choice else {}),
            "memory_margin": result.memory_margin(),
            "host_memory": mem.host_memory_of(req.spec, result.chosen.setup, req.host_capacity_bytes).as_dict(),
            "rejected": list(dict.fromkeys(result.rejected))[:50],
            "plan_path": None,
        }


# --- enumeration helpers ---------------------------------------------------------------------------------------
def auto_loss_chunk(spec: ModelSpec) -> int:
    """Tokens per loss chunk when the planner chunks the loss (LOSS_CHUNK_ELEMENTS)."""
    c = 1 << max(0, (LOSS_CHUNK_ELEMENTS // max(1, spec.vocab_size)).bit_length() - 1)
    return min(8192, max(256, c))


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
    """The tensor-parallel degrees to search: the pin, or valid_tp (those a pinned loss chunk allows)."""
    if req.tp is not None:
        return [req.tp]  # checked by PlanRequest
    tps = valid_tp(req.spec, req.gpus_per_node)
    uneven = [t for t in tps if req.seq_len % t]
    if uneven:  # sequence parallelism splits the sequence evenly over the tp ranks
        rejected.append(f"tensor parallelism {', '.join(map(str, uneven))}: seq len {req.seq_len} does not divide")
        tps = [t for t in tps if not req.seq_len % t]
    if req.loss_chunk_tokens and len(tps) > 1:
        rejected.append(f"tensor parallelism: --loss-chunk {req.loss_chunk_tokens} (TP computes the loss unchunked)")
        return [1]
    if req.finetune.adapters and len(tps) > 1:  # llmctl.spec.setup: the engine runs adapters at tp 1 only
        rejected.append(f"tensor parallelism: {req.finetune.method} adapters run at tp 1 in llmctl's engine")
        return [1]
    if req.precision.float8 and len(tps) > 1:  # llmctl.spec.setup: the engine runs float8 at tp 1 only
        rejected.append(f"tensor parallelism: {req.precision.name} runs at tp 1 in llmctl's engine")
        return [1]
    return tps


def cp_degrees(req: PlanRequest, attns: list[str], rejected: list[str]) -> list[int]:
    """The context-parallel degrees to search: the pin, or 1 and the powers of two up to the cluster's GPUs whose
    ring the model's attention runs (llmctl.families.context_parallel.cp_problem) on SDPA (a pinned flash or eager
    kernel rules it out), and whose 2cp head-tail chunks split the sequence (each rank's part split again by some tp
    searched; per tp: `TrainSetup`)."""
    if req.cp is not None:
        return [req.cp]  # checked by PlanRequest
    world = req.nodes * req.gpus_per_node
    if world < 2:
        return [1]
    problem = cp_problem(req.spec, req.seq_len)
    if problem:
        rejected.append(f"context parallelism: {problem}")
        return [1]
    if "sdpa" not in attns:
        rejected.append(f"context parallelism: ring attention runs on SDPA, not --attention {req.attention}")
        return [1]
    cps, cp = [1], 2
    while cp <= world:
        if world % cp == 0 and req.seq_len % (2 * cp) == 0:
            cps.append(cp)
        cp *= 2
    return cps


def parallel_degrees(req: PlanRequest, tps: list[int], cps: list[int], rejected: list[str]) -> list[tuple[int, int]]:
    """The (tp, cp) pairs to search: those that split the GPUs and the sequence (llmctl.spec.setup)."""
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


def _loss_chunks(req: PlanRequest, spec: ModelSpec, rejected: list[str]) -> list[int]:
    """The loss chunks to search (tp = 1; tp > 1 computes the loss on vocabulary shards): the pin, else whole logits
    and auto_loss_chunk, but past LONG_CONTEXT_TOKENS only the chunked loss (it stays on: the logits of one long
    sequence are many GiB, and a plan that runs at one length should not lose the chunks at the next)."""
    if req.loss_chunk_tokens is not None:
        return [req.loss_chunk_tokens]
    if req.seq_len > LONG_CONTEXT_TOKENS:
        rejected.append(
            f"whole logits (--loss-chunk 0): past {LONG_CONTEXT_TOKENS:,} tokens the loss stays chunked "
            f"(tp > 1: on vocabulary shards)"
        )
        return [auto_loss_chunk(spec)]
    return [0, auto_loss_chunk(spec)]


def plan(req: PlanRequest) -> PlanResult:
    """Enumerate, filter by memory, predict, rank. Raises DoesNotFitError with the reasons when nothing is left.
    CPU offload: as pinned, else searched where nothing fits without it or where it could win (module docstring)."""
    if req.finetune.adapters:  # no CPU offload with adapters (llmctl.spec.setup); the methods compared
        result = _plan(req)
        return replace(result, finetune_choice=explain_finetune(req, result.chosen))
    if req.offload is not None:
        result = _plan(req)
        return replace(result, offload_choice=explain_offload(req, result.chosen, None))
    with_offload = replace(req, offload=True)
    try:
        first = _plan(req)
    except DoesNotFitError as without:
        try:
            result = _plan(with_offload, offload_pinned=False)
        except DoesNotFitError as again:
            fewest = min((n for n in (without.fewest_gpus, again.fewest_gpus) if n), default=None)
            raise DoesNotFitError(f"{without.message}; with CPU offload: {again.message}", again.hint, fewest) from None
        why = f"on: no setup fits the GPUs without it ({without.message})"
        return replace(result, offload_choice=explain_offload(with_offload, result.chosen, why))
    if not offload_can_win(req, first.chosen, _offload_families(req)):
        return first
    try:
        second = _plan(with_offload, offload_pinned=False)
    except DoesNotFitError:
        return first
    if sort_key(req, second.chosen) >= sort_key(req, first.chosen):
        return first
    why = offload_won(req, first.chosen, second.chosen)
    return replace(second, offload_choice=explain_offload(with_offload, second.chosen, why))


def _offload_families(req: PlanRequest) -> list[OffloadFamily]:
    """The search's (tp, cp, strategy, nodes) families, each at its fastest: the whole per-rank batch (or the pinned
    micro-batch), the least recompute and loss chunk searched, the fastest kernel allowed, compiled where it may be
    (what llmctl.plan.search.offload_can_win bounds offload with)."""
    spec, g, rejected = req.spec, req.gpus_per_node, []
    fast = "flash" if req.precision.flash_attention and req.gpu.flash_attention else "sdpa"
    fast = spec.attention_kernel(req.attention or fast)
    strategies = [req.strategy] if req.strategy else list(ENGINE_STRATEGIES)
    chunk = min(_loss_chunks(req, spec, rejected))
    out = []
    for tp, cp in parallel_degrees(req, tp_degrees(req, rejected), cp_degrees(req, [fast, "sdpa"], rejected), rejected):
        for n, strategy in itertools.product(req.node_options(), strategies):
            dp = n * g // (tp * cp) if (n * g) % (tp * cp) == 0 else 0
            hybrid_off = strategy == "hybrid_shard" and (n < 2 or g % (tp * cp) or g // (tp * cp) < 2)
            if dp and not req.global_batch % dp and not hybrid_off:
                out.append(OffloadFamily(tp, cp, strategy, n, fast if cp == 1 else "sdpa", 0 if tp > 1 else chunk))
    return out


def _plan(req: PlanRequest, offload_pinned: bool = True) -> PlanResult:
    """One search, with CPU offload as the request says (off when None); `offload_pinned` False: on because nothing
    fit without it, not a pin to drop."""
    spec, gpu, g, G = req.spec, req.gpu, req.gpus_per_node, req.global_batch
    gpu.peak_tflops(req.compute_dtype)  # no native dtype (bf16 on V100): one clear error now
    if req.precision.float8 and spec.measured is None and not f8.linear_count(spec):
        # as the engine refuses it (llmctl.engine.float8.convert): float8 would buy nothing
        raise InputError(
            f"precision {req.precision.name}: {spec.name} has no linear layer float8 converts "
            "(GPT-2's projections are Conv1D, not nn.Linear)",
            hint="use --precision bf16-mixed",
        )
    strategies = [req.strategy] if req.strategy else list(ENGINE_STRATEGIES)
    ckpts = [req.checkpointing] if req.checkpointing else checkpointing_modes(spec)
    rejected: list[str] = []
    chunks = _loss_chunks(req, spec, rejected)
    attns = [req.attention] if req.attention else list(ATTENTIONS)
    compiles = [req.compile] if req.compile is not None else [True, False]
    if not req.precision.flash_attention or not gpu.flash_attention:
        why = (
            f"{req.compute_dtype} has no flash kernel"
            if not req.precision.flash_attention
            else f"flash-attention 2 does not run on {gpu.name}"
        )
        if req.attention == "flash":
            rejected.append(f"--attention flash: {why}")
        attns = [a for a in attns if a != "flash"]
    if req.attention and not spec.runs_kernel(req.attention):  # a pin the model cannot run: bad input
        raise InputError(
            f"--attention {req.attention}: {spec.name} ({spec.model_type}) has no {req.attention} path in transformers",
            hint=f"use --attention {spec.attention_kernel(req.attention)}, or no pin",
        )
    attns = [a for a in attns if spec.runs_kernel(a)]
    if req.strategy == "hybrid_shard" and req.nodes < 2:
        rejected.append("--strategy hybrid_shard: needs at least 2 nodes (on one node it is full_shard)")

    tps = tp_degrees(req, rejected)
    cps = cp_degrees(req, attns, rejected)
    degrees = parallel_degrees(req, tps, cps, rejected)

    def dp_ranks(n: int, tp: int, cp: int) -> int:
        """Data-parallel ranks on n nodes (0: tp x cp does not split them)."""
        return n * g // (tp * cp) if (n * g) % (tp * cp) == 0 else 0

    usable = {
        (tp, cp): [n for n in req.node_options() if dp_ranks(n, tp, cp) and G % dp_ranks(n, tp, cp) == 0]
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
        dp = dp_ranks(req.nodes, tp, cp)
        if dp and req.nodes not in usable[(tp, cp)]:
            ranks = f"{dp} GPUs" if tp * cp == 1 else f"{dp} data-parallel ranks (tp {tp} x cp {cp})"
            rejected.append(f"{req.nodes} nodes: global batch {G} is not a multiple of {ranks}")

    best: dict[tuple, Candidate] = {}
    evaluated = 0
    pruned: dict[tuple[int, int], float] = {}
    search = MemorySearch(req)
    order = {
        a: sorted(
            itertools.product(ckpts, sorted({0, *chunks})),
            key=lambda o, a=a: recompute_seconds(req, req.setup("full_shard", 1, 1, 1, o[0], a, False, o[1])),
        )
        for a in attns
    }
    top_key = [0.0]  # the best candidate's sort key so far (its first figure)

    saturated: dict[tuple, int] = {}  # (tp, strategy, nodes, kernel) -> the least cp whose cheapest option fit it all

    def group(tp: int, cp: int, strategy: str, n: int, attn: str) -> None:
        """Search one (tp, cp, strategy, nodes, kernel) family: the Pareto front of checkpointing x loss chunk."""
        nonlocal evaluated
        if strategy == "hybrid_shard" and (n < 2 or g % (tp * cp) or g // (tp * cp) < 2):
            return  # one node, or a shard group of one rank: that is full_shard, or no_shard
        if req.offload and (problem := search.host_problem(strategy, n, tp, cp)):
            rejected.append(problem)  # CPU offload's states do not fit the host's memory: no micro-batch helps
            return
        if saturated.get((tp, strategy, n, attn), cp) < cp:
            # A smaller cp ran the whole per-rank batch in one micro-batch without recompute: a larger one runs the
            # same tokens per GPU in GEMMs as large at best, and its ring only adds communication.
            return
        per_rank = G // dp_ranks(n, tp, cp)
        top = req.micro_batch or per_rank  # the largest micro-batch worth fitting
        # Ring attention: the all-to-all rotation never holds more than the all-gather's buffers
        # (llmctl.plan.memory.ring), so its memory search stands for both; the all-gather is timed beside it where it
        # fits (equal predictions keep it: torch's and torchtitan's default).
        rotate = "alltoall" if cp > 1 else "allgather"
        # Pareto front, cheapest recompute first: an option is worth its memory search and timing only if it fits a
        # larger micro-batch than every cheaper one (at an equal micro-batch the cheaper recompute is faster, at every
        # micro-batch, since both scale with its tokens); once one fits the whole per-rank batch, nothing dearer can
        # win. Thousands of dominated setups are never searched or timed.
        largest = 0
        for k, (ckpt, chunk) in enumerate(o for o in order[attn] if (o[1] == 0 if tp > 1 else o[1] in chunks)):
            # (TP computes the loss on vocabulary shards, loss parallel: unchunked.)
            if largest >= top:
                break
            mbs = search.micro_batches(strategy, n, ckpt, attn, chunk, per_rank, rejected, tp, cp, rotate)
            if k == 0 and mbs and mbs[-1] >= top:  # the cheapest option runs the whole batch at once
                saturated[(tp, strategy, n, attn)] = min(cp, saturated.get((tp, strategy, n, attn), cp))
            # At an equal micro-batch the order by recompute (priced at mb 1, without compile) can disagree with
            # the timed step (memory-bound recompute does not scale with the GEMM efficiency): time both.
            if not mbs or mbs[-1] < largest:
                continue
            largest = mb = mbs[-1]
            # Only the largest micro-batch that fits is timed: a step's compute time falls with the micro-batch
            # (the GEMM-shape efficiency rises with the tokens per micro-batch) and so does its communication
            # (fewer micro-batches, each hiding more behind longer compute).
            if cp == 1:
                for comp in compiles:
                    async_tp = tp > 1 and comp and req.async_tp  # async TP only hides communication
                    keep(
                        evaluate(req, req.setup(strategy, n, mb, per_rank // mb, ckpt, attn, comp, chunk, tp, async_tp))
                    )
                continue
            # Ring attention: compile only ever speeds a step up in this model (COMPILE_SPEEDUP, and async TP), so only
            # the faster is timed; the all-gather rotation, where it fits, replaces the all-to-all's when its ring
            # hides as much (equal predictions keep it: torch's and torchtitan's default).
            comp = max(compiles)
            async_tp = tp > 1 and comp and req.async_tp
            setup = req.setup(strategy, n, mb, per_rank // mb, ckpt, attn, comp, chunk, tp, async_tp, cp, rotate)
            c = evaluate(req, setup)
            gathered = replace(setup, cp_rotate="allgather")
            if (
                cp_comm(req, gathered, c.predicted.efficiency).exposed_s <= c.predicted.cp_comm_exposed_s
                and mem.estimate(spec, mem.memory_key(gathered)).device_bytes <= req.capacity_bytes
            ):
                c = evaluate(req, gathered)
            keep(c)

    def keep(c: Candidate) -> None:
        """Count a timed setup and keep it if it is its family's best so far."""
        nonlocal evaluated
        evaluated += 1
        s = c.setup
        key = (s.tp, s.cp, s.strategy, s.nodes, s.checkpointing, s.attention, s.compile, s.loss_chunk_tokens)
        if key not in best or sort_key(req, c) < sort_key(req, best[key]):
            best[key] = c
        top_key[0] = min(top_key[0], sort_key(req, c)[0])

    # Without TP or CP every data-parallel family is searched: the table compares them.
    for strategy in strategies:
        for n in usable.get((1, 1), []):
            for attn in attns:
                group(1, 1, strategy, n, attn)
    # With TP, a (tp, nodes, kernel) family is searched only if its compute alone (no communication, no recompute, the
    # largest micro-batch) could beat the best setup so far: most node counts of a large cluster cannot.
    bounds = sorted(
        (
            (parallel_bound(req, tp, 1, n, attn, max(compiles)), tp, n, attn)
            for tp, cp in degrees
            if tp > 1 and cp == 1
            for n in usable[(tp, cp)]
            for attn in attns
        ),
        key=lambda b: -b[0],
    )
    for bound, tp, n, attn in bounds:
        if best and bound < -top_key[0]:
            pruned[(tp, 1)] = max(pruned.get((tp, 1), 0.0), bound)
            continue
        for strategy in strategies:
            group(tp, 1, strategy, n, attn)
    # With CP, after every family without it: ring attention runs on SDPA, and such a family is searched only if its
    # compute at the largest micro-batch with the least recompute that lets micro-batch 1 fit, plus its ring's exposed
    # exchanges (`MemorySearch.ring_bound`), could beat the best setup so far.
    ring_bounds = sorted(
        (
            (search.ring_bound(tp, cp, n, strategies, order["sdpa"], chunks, max(compiles)), tp, cp, n)
            for tp, cp in degrees
            if cp > 1 and "sdpa" in attns
            for n in usable[(tp, cp)]
        ),
        key=lambda b: -b[0],
    )
    ring_pruned: dict[tuple[int, int], float] = {}
    for bound, tp, cp, n in ring_bounds:
        if best and bound < -top_key[0]:
            ring_pruned[(tp, cp)] = max(ring_pruned.get((tp, cp), 0.0), bound)
            continue
        for strategy in strategies:
            group(tp, cp, strategy, n, "sdpa")
    metric = "tokens/s" if req.objective == "throughput" else "tokens/s per GPU"
    for (tp, cp), bound in pruned.items():
        what = " x ".join(f"{k} {v}" for k, v in (("TP", tp), ("CP", cp)) if v > 1)
        rejected.append(
            f"{what} on some node counts: at most {bound:,.0f} {metric} even without communication or recompute, "
            f"below the best {-top_key[0]:,.0f}"
        )
    for (tp, cp), bound in ring_pruned.items():
        what = " x ".join(f"{k} {v}" for k, v in (("CP", cp), ("TP", tp)) if v > 1)
        rejected.append(
            f"{what} on some node counts: at most {bound:,.0f} {metric} with the least recompute that fits and no "
            f"communication but the ring's, below the best {-top_key[0]:,.0f}"
        )
    pruned.update(ring_pruned)
    if not best:
        _nothing_fits(req, rejected, offload_pinned)
    ranked = sorted(best.values(), key=lambda c: sort_key(req, c))[: None if req.explain else 1]
    mem_cache: dict[TrainSetup, int] = {}
    filled = []
    for c in ranked:
        # Memory depends on accumulation only as whether there is any (memory_key), not on compile.
        k = mem.memory_key(c.setup)
        if k not in mem_cache:
            mem_cache[k] = mem.estimate(spec, k).device_bytes
        filled.append(replace(c, predicted=replace(c.predicted, memory_per_gpu_bytes=mem_cache[k])))
    families: dict[tuple, Candidate] = {}
    for c in filled:
        # One row per (tp, cp or not, strategy, nodes, recompute or not): the best of selective / partial / full stands
        # for checkpointing, the best cp degree for cp (rows per mode or degree would crowd out the strategies);
        # memory_choice compares the modes, cp_choice the degrees.
        s = c.setup
        families.setdefault((s.tp, s.cp > 1, s.strategy, s.nodes, s.checkpointing != "none"), c)
    fam = list(families.values())
    why = {i: why_lost(c, fam[0], req) for i, c in enumerate(fam) if i > 0}
    choice = explain_memory_choice(req, fam[0], search, ckpts, chunks)
    tp_pruned: dict[int, float] = {}
    for (tp, _), bound in pruned.items():
        if tp > 1:
            tp_pruned[tp] = max(tp_pruned.get(tp, 0.0), bound)
    tp_choice = explain_tp_choice(req, fam[0], filled, tps, tp_pruned)
    cp_choice = explain_cp_choice(req, fam[0], filled, cps, pruned)
    precision_choice = explain_precision(req, fam[0])
    explained = (choice, tp_choice, cp_choice, precision_choice, step_split(req, fam[0]))
    return PlanResult(req, fam[0], fam, why, filled, rejected, evaluated, *explained)


def _nothing_fits(req: PlanRequest, rejected: list[str], offload_pinned: bool = True) -> None:
    pinned = [
        f"--{k.replace('_', '-')} {v}"
        for k, v in (
            ("strategy", req.strategy),
            ("micro_batch", req.micro_batch),
            ("checkpointing", req.checkpointing),
            ("attention", req.attention),
            ("tp", req.tp),
            ("cp", req.cp),
        )
        if v is not None
    ]
    if req.compile is not None:
        pinned.append("--compile" if req.compile else "--no-compile")
    if req.offload is not None and offload_pinned:
        pinned.append("--offload" if req.offload else "--no-offload")
    unique = list(dict.fromkeys(rejected))
    reasons = "; ".join(unique[:3]) + (f" (+{len(unique) - 3} more)" if len(unique) > 3 else "") or "no candidate"
    host_reasons = [r for r in unique if "host memory" in r] if req.offload else []
    smaller = ""  # CPU offload's host memory: the states' own lever
    if host_reasons and req.optimizer_states == "auto" and req.precision.optimizer_state_dtype == "fp32":
        smaller = ", or --optimizer-states bf16: AdamW's moments in bf16, 4 bytes a parameter less on the host"
    if pinned:
        hint = "drop a pin to let the planner choose"
        if host_reasons:
            hint = "use more nodes (each holds its GPUs' share of the states on the host)" + smaller
        raise DoesNotFitError(f"no setup satisfies {' '.join(pinned)}: {reasons}", hint=hint)
    best_attn = req.spec.attention_kernel(
        "flash" if req.precision.flash_attention and req.gpu.flash_attention else "sdpa"
    )
    chunk = _loss_chunks(req, req.spec, [])[-1]
    setup = req.setup("full_shard", 1, 1, 1, "full", best_attn, False, chunk)
    host = req.host_capacity_bytes if req.offload else None
    m = mem.min_gpus(req.spec, setup, req.capacity_bytes, "full_shard", host_memory_bytes=host)
    where = f"{req.nodes} x {req.gpus_per_node} {req.gpu.name}"
    if m.gpus is None and cp_problem(req.spec, req.seq_len) is None:
        _fewest_with_cp(req, chunk, where)
    if m.gpus is None:
        raise DoesNotFitError(
            f"{req.spec.name} does not fit on {where} in any setup, nor on any number of {req.gpu.name} ({m.note})",
            hint="use a GPU with more memory or tensor parallelism",
        )
    shape = (
        f"{m.nodes} node{'s' if (m.nodes or 0) > 1 else ''} x {req.gpus_per_node}"
        if (m.nodes or 0) > 1
        else f"{m.gpus} GPUs on one node"
    )
    why = f" ({host_reasons[0]})" if host_reasons else ""
    raise DoesNotFitError(
        f"{req.spec.name} does not fit on {where} in any setup{why}; the smallest cluster of "
        f"{req.gpu.name} that fits is {shape} ({m.gpus} GPUs) with full_shard, checkpointing, "
        f"{best_attn} attention, micro-batch 1{' and CPU offload' if req.offload else ''} "
        f"({(m.device_bytes or 0) / GIB:.1f} GiB per GPU)",
        hint=f"pass --gpus {m.gpus} or more" + (f" (--nodes {m.nodes})" if (m.nodes or 0) > 1 else "") + smaller,
        fewest_gpus=m.gpus,
    )


def _fewest_with_cp(req: PlanRequest, chunk: int, where: str, max_gpus: int = 1 << 17) -> None:
    """When no GPU count fits without context parallelism: the fewest GPUs that fit with it (cp = the GPUs, whole
    nodes past one; full_shard, full checkpointing, micro-batch 1), as the DoesNotFitError to raise; nothing if none
    up to `max_gpus` does."""
    g, cp = req.gpus_per_node, 2
    while cp <= max_gpus and req.seq_len % (2 * cp) == 0:
        nodes = -(-cp // g)
        setup = req.setup("full_shard", nodes, 1, 1, "full", "sdpa", False, chunk, cp=cp)
        if (nodes * g) % cp == 0:
            e = mem.estimate(req.spec, setup)
            if e.device_bytes <= req.capacity_bytes:
                gpus = nodes * g
                raise DoesNotFitError(
                    f"{req.spec.name} does not fit on {where} in any setup; with context parallelism the smallest "
                    f"cluster of {req.gpu.name} that fits is {nodes} node{'s' if nodes > 1 else ''} x {g} ({gpus} "
                    f"GPUs): cp {cp} ({req.seq_len // cp:,} tokens of each sequence per GPU), full_shard, full "
                    f"checkpointing, micro-batch 1 ({e.device_bytes / GIB:.1f} GiB per GPU)",
                    hint=f"pass --nodes {nodes} --gpus-per-node {g} or more",
                    fewest_gpus=gpus,
                )
        cp *= 2
