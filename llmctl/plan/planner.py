"""The planner: enumerate setups, drop what does not fit, predict step time and tokens/s, rank, explain (torch-free).

Search space: strategy (full_shard, hybrid_shard, no_shard: what the engine runs) x nodes used
(powers of two and divisors of the cluster's node count: on a slow network fewer nodes can win) x micro-batch
(divisors of the per-GPU batch, up to memory.max_micro_batch) x gradient accumulation (the global batch is held
fixed: micro_batch x accumulation x data-parallel ranks = global batch) x checkpointing x attention kernel x compile.

Step time = compute (hardware FLOPs / (peak x achievable efficiency)) + exposed communication (comm.step_comm).
Memory comes from llmctl.plan.memory only; this module never re-derives a byte.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmctl.errors import DoesNotFitError, InputError, SpecError
from llmctl.plan import comm as cm
from llmctl.plan import flops as fl
from llmctl.plan import memory as mem
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import planfile as pf
from llmctl.spec import precision as prec
from llmctl.spec.hardware import GIB, GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import ENGINE_STRATEGIES, ParallelDims, canonical_strategy
from llmctl.spec.precision import ENGINE_PRECISIONS, PRECISIONS

OBJECTIVES = ("throughput", "cost")

# --- achievable efficiency: the fraction of dense peak a training step reaches, in hardware FLOPs ---------------
# Per attention kernel, for large GEMMs (hidden >= 4096, >= 4k tokens per micro-batch), bf16 on A100/H100.
# flash: docs/sources.md#fsdp-seed measured 16,000 tok/s for Llama-2-7B (s=1024, checkpointing) on 4 A100s = 0.70 of peak in
#   hardware FLOPs; torchtitan reports ~0.55-0.60 MFU-equivalent for Llama-3-8B on H100. We take 0.72 before shape
#   effects (~0.67 after them for Llama-2-7B at 32k tokens per micro-batch).
# sdpa: torch's SDPA dispatches to a FlashAttention-2 kernel for bf16 on sm80+, but Hugging Face's sdpa path adds
#   transposes/contiguous copies and a masked fallback: ~10% below flash (HF "GPU inference/training" docs).
# eager: that run's throughput before flash-attention was 8,000 tok/s (half of 16,000): s^2 softmax in fp32,
#   memory-bound, so about half the flash efficiency at s=1024.
KERNEL_EFFICIENCY = {"flash": 0.72, "sdpa": 0.65, "eager": 0.37}
# GEMM shape: efficiency rises with the rows of each GEMM (tokens per micro-batch, m) and with the hidden size
# (h): a saturating m/(m + TOKENS_HALF) x h/(h + HIDDEN_HALF) (NVIDIA "Matrix Multiplication Background" guide:
# small M or K leave the tensor cores under-fed; arithmetic intensity grows with each dimension). TOKENS_HALF is
# for the whole step, not one GEMM: launch overheads, norms and elementwise kernels also amortise over m
# (mb=1 x 1024 tokens -> 0.8 of the large-batch rate, 4k tokens -> 0.94, 32k -> 0.99).
TOKENS_HALF = 256
HIDDEN_HALF = 256
# Tensor cores need dims that are multiples of 64 on A100 (docs/sources.md#fsdp-seed: "our tensor shapes must be a multiple of
# 64"); hidden or MLP sizes that are not run at a reduced rate. The engine pads the vocabulary itself.
MISALIGNED_PENALTY = 0.85
# Per GPU kind, relative to A100 (where the kernel factors come from): the catalog's `efficiency` field
# (spec/presets/gpus.yaml, each with its source).
# torch.compile fuses norms, rotary and SwiGLU elementwise ops: torchtitan reports ~1.1x on Llama-3-8B.
COMPILE_SPEEDUP = 1.10
# Memory-bound kernels (norms, rotary, activations, elementwise products: what selective checkpointing regenerates)
# stream their tensors through device memory. Unfused, as PyTorch eager runs them, they reach well below a STREAM-like
# copy (~90% of peak on A100/H100): 0.7 of the catalog's hbm_gbytes_s is the stated assumption.
HBM_EFFICIENCY = 0.7
# Chunked loss: one chunk's logits are about 2^26 elements (512 MiB for the fp32 log-softmax and its gradient in
# backward): 512 tokens for Llama 3's 128k vocabulary, 2048 for Llama 2's 32k; never below 256 tokens (smaller
# GEMMs lose efficiency) nor above 8192.
LOSS_CHUNK_ELEMENTS = 2**26
DEFAULT_GLOBAL_BATCH_SEQS = 128
"""Default global batch when none is given: max(128 sequences, one per GPU)."""


@dataclass(frozen=True)
class Efficiency:
    """The achievable-efficiency factors, all overridable; `calibration` multiplies them (--calibrate)."""

    kernel: dict[str, float] = field(default_factory=lambda: dict(KERNEL_EFFICIENCY))
    tokens_half: float = TOKENS_HALF
    hidden_half: float = HIDDEN_HALF
    misaligned_penalty: float = MISALIGNED_PENALTY
    compile_speedup: float = COMPILE_SPEEDUP
    calibration: float = 1.0

    def __post_init__(self) -> None:
        if self.calibration <= 0 or self.compile_speedup <= 0:
            raise InputError("efficiency calibration and compile speedup must be positive")

    def of(
        self, attention: str, tokens_per_micro_batch: int, spec: ModelSpec, compile_: bool, gpu: GPUSpec | None = None
    ) -> float:
        """Fraction of peak (hardware FLOPs) one GPU reaches; never above 1. `gpu` None: the baseline GPU (1.0)."""
        m, h = tokens_per_micro_batch, spec.hidden_size
        e = self.kernel[attention] * m / (m + self.tokens_half) * h / (h + self.hidden_half)
        e *= gpu.efficiency if gpu is not None else 1.0
        if spec.hidden_size % 64 or spec.intermediate_size % 64:
            e *= self.misaligned_penalty
        if compile_:
            e *= self.compile_speedup
        return min(1.0, e * self.calibration)


@dataclass(frozen=True)
class PlanRequest:
    """Everything the planner needs; pins (strategy, micro_batch, ...) are None when free."""

    spec: ModelSpec
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    network: cm.Network
    seq_len: int = 2048
    global_batch_seqs: int | None = None
    token_budget: int | None = None
    price_per_gpu_hour: float | None = None
    objective: str = "throughput"
    precision: str = "bf16-mixed"
    strategy: str | None = None
    micro_batch: int | None = None
    checkpointing: str | None = None
    attention: str | None = None
    compile: bool | None = None
    loss_chunk_tokens: int | None = None
    """Pin: 0 whole logits, N chunks of N tokens; None: the planner tries both (auto_loss_chunk)."""
    overlap: float = cm.DEFAULT_OVERLAP
    efficiency: Efficiency = field(default_factory=Efficiency)
    sync_every_micro_batch: bool = True

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "seq_len"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {getattr(self, name)}")
        if self.global_batch_seqs is not None and self.global_batch_seqs < 1:
            raise InputError(f"global batch must be >= 1 sequence, got {self.global_batch_seqs}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise InputError(f"--micro-batch must be >= 1, got {self.micro_batch}")
        if self.token_budget is not None and self.token_budget < 1:
            raise InputError(f"token budget must be >= 1, got {self.token_budget}")
        if self.price_per_gpu_hour is not None and self.price_per_gpu_hour < 0:
            raise InputError(f"price per GPU-hour must be >= 0, got {self.price_per_gpu_hour}")
        if self.objective not in OBJECTIVES:
            raise InputError(f"unknown objective {self.objective!r}", hint="throughput or cost")
        if not 0 <= self.overlap <= 1:
            raise InputError(f"--overlap must be in [0, 1], got {self.overlap}")
        object.__setattr__(self, "precision", mem.canonical(self.precision, PRECISIONS, "precision"))
        if self.precision not in ENGINE_PRECISIONS:
            raise InputError(
                f"precision {self.precision} is not run by llmctl's engine (it needs loss scaling)",
                hint="one of: " + ", ".join(ENGINE_PRECISIONS),
            )
        if self.strategy is not None:
            s = canonical_strategy(self.strategy)
            if s not in ENGINE_STRATEGIES:
                raise InputError(
                    f"strategy {s} is not run by llmctl's engine", hint="one of: " + ", ".join(ENGINE_STRATEGIES)
                )
            object.__setattr__(self, "strategy", s)
        if self.checkpointing is not None:
            object.__setattr__(self, "checkpointing", ckpt_modes.parse(self.checkpointing))
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 0:
            raise InputError(f"--loss-chunk must be >= 0 tokens, got {self.loss_chunk_tokens}")
        if self.attention is not None:
            object.__setattr__(self, "attention", mem.canonical(self.attention, mem.ATTENTIONS, "attention"))

    @property
    def global_batch(self) -> int:
        return self.global_batch_seqs or max(DEFAULT_GLOBAL_BATCH_SEQS, self.nodes * self.gpus_per_node)

    @property
    def compute_dtype(self) -> str:
        return prec.compute_dtype(self.precision)


@dataclass(frozen=True)
class Candidate:
    strategy: str
    nodes: int
    gpus_per_node: int
    micro_batch: int
    grad_accum: int
    checkpointing: str
    attention: str
    compile: bool
    loss_chunk_tokens: int
    efficiency: float
    compute_s: float
    comm_total_s: float
    comm_exposed_s: float
    step_time_s: float
    tokens_per_step: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_per_gpu_bytes: int
    bottleneck: str
    comm_ops: list[cm.CommOp] = field(default_factory=list, compare=False, repr=False)
    budget_time_s: float | None = None
    budget_cost_usd: float | None = None

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def label(self) -> str:
        return f"{self.strategy.upper()} over {self.nodes} node{'s' if self.nodes > 1 else ''}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "nodes": self.nodes,
            "gpus": self.gpus,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "checkpointing": self.checkpointing,
            "attention": self.attention,
            "compile": self.compile,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "comm_total_s": self.comm_total_s,
            "comm_exposed_s": self.comm_exposed_s,
            "efficiency": self.efficiency,
            "bottleneck": self.bottleneck,
            "budget_time_s": self.budget_time_s,
            "budget_cost_usd": self.budget_cost_usd,
        }


@dataclass(frozen=True)
class PlanResult:
    request: PlanRequest
    chosen: Candidate
    candidates: list[Candidate]
    """Ranked best first; the best setup of each (strategy, nodes used, recompute or not) family: the alternatives a
    person weighs (the modes, kernel, loss and compile variants of one family are in `variants`; `memory_choice`
    compares the checkpointing modes of the chosen strategy)."""
    why_lost: dict[int, str]
    """Index into candidates -> one sentence."""
    variants: list[Candidate]
    """Every (strategy, nodes, checkpointing, attention, compile, loss chunk) at its best micro-batch, ranked."""
    rejected: list[str]
    """Why whole families were dropped (does not fit, pins, batch does not split)."""
    evaluated: int
    memory_choice: str = ""
    """Why this checkpointing and loss: what the other modes would fit and cost on the same strategy and nodes."""


# --- enumeration helpers ---------------------------------------------------------------------------------------
def node_counts(total: int) -> list[int]:
    """Nodes to try: powers of two up to the cluster, the whole cluster, and every divisor for small clusters."""
    out = {total}
    p = 1
    while p <= total:
        out.add(p)
        p *= 2
    if total <= 64:
        out.update(d for d in range(1, total + 1) if total % d == 0)
    return sorted(out)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def auto_loss_chunk(spec: ModelSpec) -> int:
    """Tokens per loss chunk when the planner chunks the loss (LOSS_CHUNK_ELEMENTS)."""
    c = 1 << max(0, (LOSS_CHUNK_ELEMENTS // max(1, spec.vocab_size)).bit_length() - 1)
    return min(8192, max(256, c))


def checkpointing_modes(spec: ModelSpec) -> list[str]:
    """What the planner tries: none, partial:K for the planner's K (when they checkpoint a distinct number of
    layers), selective, full."""
    out = ["none"]
    seen = set()
    for k in ckpt_modes.PLANNER_PARTIAL:
        n = spec.num_layers // k
        if 0 < n < spec.num_layers and n not in seen:
            seen.add(n)
            out.append(f"partial:{k}")
    return out + ["selective", "full"]


def recompute_memory_s(req: PlanRequest, mb: int, ckpt: str, attention: str) -> float:
    """Seconds per micro-batch of the memory-bound ops selective checkpointing regenerates: each tensor a block
    would keep without checkpointing and selective does not keep is written again after its input is read (2x its
    bytes through device memory, at HBM_EFFICIENCY of the catalog bandwidth). Whole-block recompute (full, partial)
    re-runs the same mix of ops as the forward, which the FLOP-based efficiency already prices."""
    if ckpt != "selective" or req.gpu.hbm_gbytes_s <= 0:
        return 0.0
    cb = prec.compute_bytes(req.precision)
    regenerated = mem.recompute_buffer_bytes(req.spec, mb, req.seq_len, cb, attention, ckpt)
    return 2 * regenerated * req.spec.num_layers / (req.gpu.hbm_gbytes_s * 1e9 * HBM_EFFICIENCY)


def compute_times(
    req: PlanRequest, mb: int, ckpt: str, attention: str, compile_: bool, chunk: int = 0
) -> tuple[float, float, float]:
    """(efficiency, forward s, backward s) of one micro-batch on one GPU. Backward carries the recomputation."""
    eff = req.efficiency.of(attention, mb * req.seq_len, req.spec, compile_, req.gpu)
    rate = req.gpu.peak_tflops(req.compute_dtype) * 1e12 * eff
    tokens = mb * req.seq_len
    model = fl.model_flops_per_token(req.spec, req.seq_len)
    again = fl.recompute_flops_per_token(req.spec, req.seq_len, ckpt, attention, chunk > 0)
    fwd = tokens * (model / 3) / rate  # forward 2N + attention/3 of 6N + attention (Kaplan et al. 2020)
    redo = tokens * again / rate
    if ckpt == "selective":
        # Selective re-runs a subset of what full re-runs: never more time than full's recompute (a GPU with little
        # memory bandwidth for its FLOPs, e.g. L40S with eager attention, would otherwise price it above).
        full = fl.recompute_flops_per_token(req.spec, req.seq_len, "full", attention, chunk > 0)
        redo = min(redo + recompute_memory_s(req, mb, ckpt, attention), tokens * full / rate)
    bwd = tokens * (model * 2 / 3) / rate + redo
    return eff, fwd, bwd


def evaluate(
    req: PlanRequest,
    strategy: str,
    nodes: int,
    mb: int,
    accum: int,
    ckpt: str,
    attention: str,
    compile_: bool,
    memory_bytes: int = 0,
    chunk: int = 0,
) -> Candidate:
    """Predict one setup (no fit check: the caller decides what fits)."""
    g = req.gpus_per_node
    eff, fwd, bwd = compute_times(req, mb, ckpt, attention, compile_, chunk)
    shape = cm.CommShape(
        params=req.spec.params,
        num_layers=req.spec.num_layers,
        param_bytes=prec.compute_bytes(req.precision),
        grad_bytes=2 if req.precision == "bf16" else 4,  # the engine reduces in fp32 unless the plan is pure bf16
    )
    dims = ParallelDims.from_strategy(strategy, nodes, g)
    c = cm.step_comm(dims, shape, g, accum, fwd, bwd, req.network, req.overlap, req.sync_every_micro_batch)
    compute = accum * (fwd + bwd)
    step = compute + c.exposed_s
    gpus = nodes * g
    tokens_step = dims.tokens_per_step(mb, accum, req.seq_len)
    tps = tokens_step / step
    per_gpu = tps / gpus
    mfu = fl.mfu(req.spec, req.seq_len, per_gpu, req.gpu.peak_tflops(req.compute_dtype))
    budget_t = req.token_budget / tps if req.token_budget else None
    cost = (
        budget_t / 3600 * gpus * req.price_per_gpu_hour
        if budget_t is not None and req.price_per_gpu_hour is not None
        else None
    )
    return Candidate(
        strategy,
        nodes,
        g,
        mb,
        accum,
        ckpt,
        attention,
        compile_,
        chunk,
        eff,
        compute,
        c.total_s,
        c.exposed_s,
        step,
        tokens_step,
        tps,
        per_gpu,
        mfu,
        memory_bytes,
        c.bottleneck,
        c.ops,
        budget_t,
        cost,
    )


def predict(
    req: PlanRequest,
    strategy: str,
    nodes: int,
    mb: int,
    accum: int,
    ckpt: str,
    attention: str,
    compile_: bool,
    chunk: int = 0,
) -> Candidate:
    """One setup timed (`evaluate`) and sized (the memory model, bytes per GPU), whether or not it fits: what
    `llmctl tune` records next to each trial's measurement."""
    need = mem.estimate(req.spec, _setup(req, strategy, nodes, mb, ckpt, attention, chunk)).device_bytes
    return evaluate(req, strategy, nodes, mb, accum, ckpt, attention, compile_, memory_bytes=need, chunk=chunk)


def _setup(
    req: PlanRequest, strategy: str, nodes: int, mb: int, ckpt: str, attention: str, chunk: int = 0
) -> mem.TrainSetup:
    return mem.TrainSetup(
        precision=req.precision,
        optimizer="adamw",
        strategy=strategy,
        engine="fsdp2",
        nodes=nodes,
        gpus_per_node=req.gpus_per_node,
        micro_batch_size=mb,
        seq_len=req.seq_len,
        checkpointing=ckpt,
        attention=attention,
        loss_chunk_tokens=chunk,
    )


def _sort_key(req: PlanRequest, c: Candidate) -> tuple[float, float]:
    if req.objective == "cost":
        return (-c.tokens_per_s_per_gpu, -c.tokens_per_s)  # cost per token = GPUs x price / tokens/s
    return (-c.tokens_per_s, -c.tokens_per_s_per_gpu)


def plan(req: PlanRequest) -> PlanResult:
    """Enumerate, filter by memory, predict, rank. Raises DoesNotFitError with the reasons when nothing is left."""
    spec, gpu, g, G = req.spec, req.gpu, req.gpus_per_node, req.global_batch
    gpu.peak_tflops(req.compute_dtype)  # no native dtype (bf16 on V100): one clear error now
    strategies = [req.strategy] if req.strategy else list(ENGINE_STRATEGIES)
    ckpts = [req.checkpointing] if req.checkpointing else checkpointing_modes(spec)
    chunks = [req.loss_chunk_tokens] if req.loss_chunk_tokens is not None else [0, auto_loss_chunk(spec)]
    attns = [req.attention] if req.attention else list(mem.ATTENTIONS)
    compiles = [req.compile] if req.compile is not None else [True, False]
    rejected: list[str] = []
    if req.compute_dtype == "fp32" or not gpu.flash_attention:
        why = (
            "fp32 has no flash kernel"
            if req.compute_dtype == "fp32"
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

    usable_nodes = [n for n in node_counts(req.nodes) if G % (n * g) == 0]
    if not usable_nodes:
        raise InputError(
            f"global batch {G} sequences does not split evenly over {g} GPUs per node on any node count",
            hint=f"use a multiple of {g} (e.g. --global-batch {g * max(1, round(G / g))})",
        )
    for n in node_counts(req.nodes):
        if n not in usable_nodes and n == req.nodes:
            rejected.append(f"{n} nodes: global batch {G} is not a multiple of {n * g} GPUs")

    best: dict[tuple, Candidate] = {}
    evaluated = 0
    search = _MemorySearch(req)
    order = {
        a: sorted(itertools.product(ckpts, chunks), key=lambda o, a=a: recompute_seconds(req, o[0], a, o[1]))
        for a in attns
    }
    for strategy in strategies:
        for n in usable_nodes:
            if strategy == "hybrid_shard" and n < 2:
                continue
            per_gpu = G // (n * g)
            top = req.micro_batch or per_gpu  # the largest micro-batch worth fitting
            for attn in attns:
                # Pareto front, cheapest recompute first: an option is worth its memory search and timing only if it
                # fits a larger micro-batch than every cheaper one (at an equal micro-batch the cheaper recompute is
                # faster, at every micro-batch, since both scale with its tokens); once one fits the whole per-GPU
                # batch, nothing dearer can win. Thousands of dominated setups are never searched or timed.
                largest = 0
                for ckpt, chunk in order[attn]:
                    if largest >= top:
                        break
                    mbs = search.micro_batches(strategy, n, ckpt, attn, chunk, per_gpu, rejected)
                    # At an equal micro-batch the order by recompute (priced at mb 1, without compile) can disagree
                    # with the timed step (memory-bound recompute does not scale with the GEMM efficiency): time both.
                    if not mbs or mbs[-1] < largest:
                        continue
                    largest = mb = mbs[-1]
                    # Only the largest micro-batch that fits is timed: a step's compute time falls with the
                    # micro-batch (the GEMM-shape efficiency rises with the tokens per micro-batch) and so does its
                    # communication (fewer micro-batches, each hiding more behind longer compute).
                    for comp in compiles:
                        c = evaluate(req, strategy, n, mb, per_gpu // mb, ckpt, attn, comp, chunk=chunk)
                        evaluated += 1
                        key = (strategy, n, ckpt, attn, comp, chunk)
                        if key not in best or _sort_key(req, c) < _sort_key(req, best[key]):
                            best[key] = c
    if not best:
        _nothing_fits(req, rejected)
    ranked = sorted(best.values(), key=lambda c: _sort_key(req, c))
    mem_cache: dict[tuple, int] = {}
    filled = []
    for c in ranked:
        k = (c.strategy, c.nodes, c.micro_batch, c.checkpointing, c.attention, c.loss_chunk_tokens)
        if k not in mem_cache:
            mem_cache[k] = mem.estimate(spec, _setup(req, *k)).device_bytes
        filled.append(replace(c, memory_per_gpu_bytes=mem_cache[k]))
    families: dict[tuple, Candidate] = {}
    for c in filled:
        # One row per (strategy, nodes, recompute or not): the best of selective / partial / full stands for
        # checkpointing (rows per mode would crowd out the strategies); memory_choice compares the modes.
        families.setdefault((c.strategy, c.nodes, c.checkpointing != "none"), c)
    fam = list(families.values())
    why = {i: why_lost(c, fam[0], req) for i, c in enumerate(fam) if i > 0}
    choice = explain_memory_choice(req, fam[0], search, ckpts, chunks)
    return PlanResult(req, fam[0], fam, why, filled, rejected, evaluated, choice)


class _MemorySearch:
    """The largest micro-batch per setup (memory.max_micro_batch), cached: memory depends on the shard degree, not on
    the node count, for hybrid and no_shard, so those share one search."""

    def __init__(self, req: PlanRequest) -> None:
        self.req = req
        self.cache: dict[tuple, tuple[int, int]] = {}

    def max_mb(self, strategy: str, n: int, ckpt: str, attn: str, chunk: int, per_gpu: int) -> int:
        return min(self._search(strategy, n, ckpt, attn, chunk)[0], per_gpu)

    def _search(self, strategy: str, n: int, ckpt: str, attn: str, chunk: int) -> tuple[int, int]:
        """(largest micro-batch that fits up to the one-node per-GPU batch, bytes per GPU at micro-batch 1).
        Memory depends neither on the per-GPU batch nor, between SDPA and flash, on the kernel."""
        kernel = "eager" if attn == "eager" else "fused"
        key = (strategy, n if strategy == "full_shard" else min(n, 2), ckpt, kernel, chunk)
        if key not in self.cache:
            setup = _setup(self.req, strategy, n, 1, ckpt, attn, chunk)
            need = mem.estimate(self.req.spec, setup).device_bytes
            cap = self.req.gpu.memory_bytes
            limit = max(1, self.req.global_batch // self.req.gpus_per_node)
            fitted = mem.max_micro_batch(self.req.spec, setup, cap, limit=limit) if need <= cap else 0
            self.cache[key] = (fitted, need)
        return self.cache[key]

    def micro_batches(
        self, strategy: str, n: int, ckpt: str, attn: str, chunk: int, per_gpu: int, rejected: list[str]
    ) -> list[int]:
        """The micro-batches to try (divisors of the per-GPU batch that fit, or the pinned one), ascending; [] with
        the reason appended to `rejected` when none."""
        req, cap = self.req, self.req.gpu.memory_bytes
        max_mb = self.max_mb(strategy, n, ckpt, attn, chunk, per_gpu)
        where = (
            f"{strategy} on {n} node{'s' if n > 1 else ''}, checkpointing {ckpt}, {attn}"
            f"{f', loss chunks of {chunk}' if chunk else ''}"
        )
        if max_mb == 0:
            need = self._search(strategy, n, ckpt, attn, chunk)[1]
            rejected.append(f"{where}: micro-batch 1 needs {need / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB")
            return []
        if req.micro_batch is None:
            return [d for d in divisors(per_gpu) if d <= max_mb]
        if per_gpu % req.micro_batch:
            rejected.append(
                f"{strategy} on {n} node{'s' if n > 1 else ''}: micro-batch {req.micro_batch} does not divide the "
                f"{per_gpu} sequences per GPU (global batch {req.global_batch} over {n * req.gpus_per_node} GPUs)"
            )
            return []
        if req.micro_batch > max_mb:
            need = mem.estimate(req.spec, _setup(req, strategy, n, req.micro_batch, ckpt, attn, chunk))
            rejected.append(
                f"{where}: micro-batch {req.micro_batch} needs {need.device_bytes / GIB:.1f} GiB per GPU > "
                f"{cap / GIB:.1f} GiB"
            )
            return []
        return [req.micro_batch]


def _nothing_fits(req: PlanRequest, rejected: list[str]) -> None:
    pinned = [
        f"--{k.replace('_', '-')} {v}"
        for k, v in (
            ("strategy", req.strategy),
            ("micro_batch", req.micro_batch),
            ("checkpointing", req.checkpointing),
            ("attention", req.attention),
        )
        if v is not None
    ]
    if req.compile is not None:
        pinned.append("--compile" if req.compile else "--no-compile")
    unique = list(dict.fromkeys(rejected))
    reasons = "; ".join(unique[:3]) + (f" (+{len(unique) - 3} more)" if len(unique) > 3 else "") or "no candidate"
    if pinned:
        raise DoesNotFitError(
            f"no setup satisfies {' '.join(pinned)}: {reasons}", hint="drop a pin to let the planner choose"
        )
    best_attn = req.spec.attention_kernel(
        "sdpa" if req.compute_dtype == "fp32" or not req.gpu.flash_attention else "flash"
    )
    setup = _setup(req, "full_shard", 1, 1, "full", best_attn)
    m = mem.min_gpus(req.spec, setup, req.gpu.memory_bytes, "full_shard")
    where = f"{req.nodes} x {req.gpus_per_node} {req.gpu.name}"
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
    raise DoesNotFitError(
        f"{req.spec.name} does not fit on {where} in any setup; the smallest cluster of "
        f"{req.gpu.name} that fits is {shape} ({m.gpus} GPUs) with full_shard, checkpointing, "
        f"{best_attn} attention, micro-batch 1 ({(m.device_bytes or 0) / GIB:.1f} GiB per GPU)",
        hint=f"pass --nodes {m.nodes} or more",
    )


# --- explanations ------------------------------------------------------------------------------------------------
def recompute_cost(req: PlanRequest, c: Candidate) -> float:
    """Extra compute time per micro-batch that c's checkpointing and chunked loss add (0.19 = 19% more)."""
    base = sum(compute_times(req, c.micro_batch, "none", c.attention, c.compile, 0)[1:])
    mine = sum(compute_times(req, c.micro_batch, c.checkpointing, c.attention, c.compile, c.loss_chunk_tokens)[1:])
    return mine / base - 1 if base else 0.0


def recompute_seconds(req: PlanRequest, ckpt: str, attention: str, chunk: int) -> float:
    """Backward seconds of one single-sequence micro-batch: orders setups by their recompute (it scales with the
    tokens, so the order holds at every micro-batch)."""
    return compute_times(req, 1, ckpt, attention, False, chunk)[2]


def explain_memory_choice(
    req: PlanRequest, chosen: Candidate, search: _MemorySearch, modes: list[str], chunks: list[int]
) -> str:
    """One sentence on the chosen checkpointing mode and loss against the other modes on the same strategy, nodes,
    kernel and compile: 'selective checkpointing: micro-batch 16 fits, recompute costs 15% more compute time; no
    checkpointing: only micro-batch 4 fits (18% fewer tokens/s); full checkpointing: recompute would cost 17% more
    time'."""
    per_gpu = chosen.micro_batch * chosen.grad_accum
    loss = f", loss in chunks of {chosen.loss_chunk_tokens} tokens" if chosen.loss_chunk_tokens else ""
    cost = recompute_cost(req, chosen)
    parts = [
        f"{ckpt_modes.label(chosen.checkpointing)}{loss}: micro-batch {chosen.micro_batch} fits"
        + (f", recompute costs {cost:.0%} more compute time" if cost > 0.005 else "")
    ]
    for mode in modes:
        if mode == chosen.checkpointing:
            continue
        alts = []
        for chunk in chunks:
            for mb in search.micro_batches(
                chosen.strategy, chosen.nodes, mode, chosen.attention, chunk, per_gpu, rejected=[]
            ):
                alts.append(
                    evaluate(
                        req,
                        chosen.strategy,
                        chosen.nodes,
                        mb,
                        per_gpu // mb,
                        mode,
                        chosen.attention,
                        chosen.compile,
                        chunk=chunk,
                    )
                )
        label = ckpt_modes.label(mode)
        if not alts:
            parts.append(f"{label}: does not fit")
            continue
        alt = min(alts, key=lambda c: _sort_key(req, c))
        ratio = alt.tokens_per_s / chosen.tokens_per_s if chosen.tokens_per_s else 1.0
        if alt.micro_batch < chosen.micro_batch:
            parts.append(f"{label}: only micro-batch {alt.micro_batch} fits ({1 - ratio:.0%} fewer tokens/s)")
        elif ratio < 1:
            extra = recompute_cost(req, alt) - cost
            why = f"recompute would cost {extra:.0%} more time" if extra > 0.005 else f"{1 - ratio:.0%} fewer tokens/s"
            parts.append(f"{label}: {why}")
    return "; ".join(parts)


def why_lost(c: Candidate, best: Candidate, req: PlanRequest) -> str:
    """One sentence: the biggest reason `c` predicts fewer tokens/s (or a higher cost) than `best`."""
    ckpt = ckpt_modes.label(c.checkpointing)
    name = f"{c.label} ({ckpt}, {c.attention}{', compiled' if c.compile else ''}, mb {c.micro_batch} x {c.grad_accum})"
    ratio = c.tokens_per_s / best.tokens_per_s if best.tokens_per_s else 0.0
    if req.objective == "cost":
        ratio = c.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu if best.tokens_per_s_per_gpu else 0.0
    pct = f"{(1 - ratio) * 100:.0f}% {'fewer tokens/s' if req.objective == 'throughput' else 'more cost per token'}"
    # Compare per-GPU seconds per token, split into compute and exposed comm.
    tok_c, tok_b = c.tokens_per_step / c.gpus, best.tokens_per_step / best.gpus
    comp_d = c.compute_s / tok_c - best.compute_s / tok_b
    comm_d = c.comm_exposed_s / tok_c - best.comm_exposed_s / tok_b
    if req.objective == "throughput" and c.gpus < best.gpus and c.tokens_per_s_per_gpu >= best.tokens_per_s_per_gpu:
        return f"{name}: uses {c.gpus} GPUs vs {best.gpus}; {pct} even with less exposed communication"
    if comm_d >= comp_d and c.comm_exposed_s > 0:
        return (
            f"{name}: {c.comm_exposed_s:.2f} s/step exposed communication ({c.bottleneck}) vs "
            f"{best.comm_exposed_s:.2f} s; {pct}"
        )
    causes = []
    extra, best_extra = recompute_cost(req, c), recompute_cost(req, best)
    if extra > best_extra + 0.005:
        causes.append(
            f"recompute adds {extra:.0%} compute time" + (f" vs {best_extra:.0%}" if best_extra > 0.005 else "")
        )
    if c.attention != best.attention:
        causes.append(
            f"{c.attention} attention runs at {req.efficiency.kernel[c.attention]:.0%} of peak vs "
            f"{req.efficiency.kernel[best.attention]:.0%} for {best.attention}"
        )
    if best.compile and not c.compile:
        causes.append("no torch.compile")
    if c.gpus < best.gpus:
        causes.append(f"uses {c.gpus} GPUs vs {best.gpus}")
    if not causes and c.micro_batch < best.micro_batch:
        causes.append(f"smaller micro-batch ({c.micro_batch} vs {best.micro_batch})")
    detail = ", ".join(causes) or "slower compute"
    return f"{name}: compute {c.compute_s:.2f} s/step vs {best.compute_s:.2f} s ({detail}); {pct}"


# --- calibration -------------------------------------------------------------------------------------------------
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


# --- the plan file -----------------------------------------------------------------------------------------------
def to_plan(result: PlanResult, name: str | None = None) -> pf.Plan | None:
    """The chosen candidate as the engine's plan file (None for --params: the engine needs an architecture).
    Validated like a plan file read from disk: a request the engine could not run (a token budget of more than
    planfile.MAX_STEPS steps, a sequence longer than a GPT-2's positions) is one SpecError line, not a plan."""
    if result.request.spec.source not in ("preset", "config"):
        return None
    try:
        return _to_plan(result, name)
    except ValidationError as e:
        raise SpecError(pf.error_line(e, "the plan to write")) from None


def _to_plan(result: PlanResult, name: str | None) -> pf.Plan:
    req, c = result.request, result.chosen
    spec = req.spec
    if spec.source == "preset":
        model = pf.ModelSection(preset=spec.name)
    else:
        model = pf.ModelSection(config=spec.name)
    training = pf.TrainingSection(
        precision=req.precision,
        micro_batch_size=c.micro_batch,
        grad_accum_steps=c.grad_accum,
        seq_len=req.seq_len,
        activation_checkpointing=c.checkpointing,
        loss_chunk_tokens=c.loss_chunk_tokens,
        attention=c.attention,
        compile=c.compile,
        token_budget=req.token_budget,
        max_steps=None if req.token_budget else 1000,
    )
    return pf.Plan(
        name=name or f"{Path(spec.name).stem}-{c.strategy}-{c.nodes}x{c.gpus_per_node}",
        model=model,
        hardware=pf.HardwareSection(gpu=req.gpu.name, nodes=c.nodes, nproc_per_node=c.gpus_per_node),
        parallel=pf.ParallelSection(sharding=c.strategy),
        training=training,
        predicted=pf.Predicted(
            tokens_per_s=round(c.tokens_per_s, 1),
            tokens_per_s_per_gpu=round(c.tokens_per_s_per_gpu, 1),
            mfu=round(c.mfu, 4),
            step_time_s=round(c.step_time_s, 4),
            memory_per_gpu_bytes=c.memory_per_gpu_bytes,
            intra_node_busbw_gbytes_s=round(req.network.intra_gbytes_s, 3),
            inter_node_busbw_gbytes_s=(
                round(req.network.inter_node_gbytes_s, 3)
                if c.nodes > 1 and req.network.inter_node_gbytes_s is not None
                else None
            ),
        ),
    )
