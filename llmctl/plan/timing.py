"""Timing one setup: compute from FLOPs over the GPU's peak x achievable efficiency, plus the communication compute
does not hide (llmctl.plan.comm); a candidate is a setup plus this prediction (torch-free).

Step time = accumulation x (forward + backward of one micro-batch) + exposed communication. Memory comes from
llmctl.plan.memory only; this module never re-derives a byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.plan import comm as cm
from llmctl.plan import flops as fl
from llmctl.plan import memory as mem
from llmctl.plan.request import HBM_EFFICIENCY, PlanRequest
from llmctl.spec.setup import TrainSetup


@dataclass(frozen=True)
class Prediction:
    """What the planner's model predicts for one setup on the request's cluster."""

    efficiency: float
    """Fraction of the GPU's dense peak reached (hardware FLOPs)."""
    compute_s: float
    """Compute seconds per optimizer step."""
    comm_total_s: float
    comm_exposed_s: float
    """Communication seconds per step that compute does not hide."""
    step_time_s: float
    tokens_per_step: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_per_gpu_bytes: int
    """The memory model's device bytes per GPU (0: not sized, see `predict`)."""
    bottleneck: str
    comm_ops: list[cm.CommOp] = field(default_factory=list, compare=False, repr=False)
    budget_time_s: float | None = None
    budget_cost_usd: float | None = None


@dataclass(frozen=True)
class Candidate:
    """A setup and its prediction."""

    setup: TrainSetup
    predicted: Prediction

    @property
    def label(self) -> str:
        s = self.setup
        return f"{s.strategy.upper()} over {s.nodes} node{'s' if s.nodes > 1 else ''}"

    def as_dict(self) -> dict[str, Any]:
        s, p = self.setup, self.predicted
        return {
            "strategy": s.strategy,
            "nodes": s.nodes,
            "gpus": s.gpus,
            "micro_batch": s.micro_batch_size,
            "grad_accum": s.grad_accum_steps,
            "checkpointing": s.checkpointing,
            "attention": s.attention,
            "compile": s.compile,
            "loss_chunk_tokens": s.loss_chunk_tokens,
            "tokens_per_s": p.tokens_per_s,
            "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
            "mfu": p.mfu,
            "memory_per_gpu_bytes": p.memory_per_gpu_bytes,
            "step_time_s": p.step_time_s,
            "compute_s": p.compute_s,
            "comm_total_s": p.comm_total_s,
            "comm_exposed_s": p.comm_exposed_s,
            "efficiency": p.efficiency,
            "bottleneck": p.bottleneck,
            "budget_time_s": p.budget_time_s,
            "budget_cost_usd": p.budget_cost_usd,
        }


def recompute_memory_s(req: PlanRequest, setup: TrainSetup) -> float:
    """Seconds per micro-batch of the memory-bound ops selective checkpointing regenerates: each tensor a block
    would keep without checkpointing and selective does not keep is written again after its input is read (2x its
    bytes through device memory, at HBM_EFFICIENCY of the catalog bandwidth). Whole-block recompute (full, partial)
    re-runs the same mix of ops as the forward, which the FLOP-based efficiency already prices."""
    if setup.checkpointing != "selective" or req.gpu.hbm_gbytes_s <= 0:
        return 0.0
    regenerated = mem.recompute_buffer_bytes(
        req.spec, setup.micro_batch_size, req.seq_len, setup.compute_bytes, setup.attention, setup.checkpointing
    )
    return 2 * regenerated * req.spec.num_layers / (req.gpu.hbm_gbytes_s * 1e9 * HBM_EFFICIENCY)


def compute_times(req: PlanRequest, setup: TrainSetup) -> tuple[float, float, float]:
    """(efficiency, forward s, backward s) of one micro-batch on one GPU. Backward carries the recomputation."""
    mb, ckpt, attention, chunked = (
        setup.micro_batch_size,
        setup.checkpointing,
        setup.attention,
        setup.loss_chunk_tokens > 0,
    )
    eff = req.efficiency.of(attention, mb * req.seq_len, req.spec, setup.compile, req.gpu)
    rate = req.gpu.peak_tflops(req.compute_dtype) * 1e12 * eff
    tokens = mb * req.seq_len
    model = fl.model_flops_per_token(req.spec, req.seq_len)
    again = fl.recompute_flops_per_token(req.spec, req.seq_len, ckpt, attention, chunked)
    fwd = tokens * (model / 3) / rate  # forward 2N + attention/3 of 6N + attention (Kaplan et al. 2020)
    redo = tokens * again / rate
    if ckpt == "selective":
        # Selective re-runs a subset of what full re-runs: never more time than full's recompute (a GPU with little
        # memory bandwidth for its FLOPs, e.g. L40S with eager attention, would otherwise price it above).
        full = fl.recompute_flops_per_token(req.spec, req.seq_len, "full", attention, chunked)
        redo = min(redo + recompute_memory_s(req, setup), tokens * full / rate)
    bwd = tokens * (model * 2 / 3) / rate + redo
    return eff, fwd, bwd


def evaluate(req: PlanRequest, setup: TrainSetup, memory_bytes: int = 0) -> Candidate:
    """Predict one setup (no fit check: the caller decides what fits)."""
    g = setup.gpus_per_node
    eff, fwd, bwd = compute_times(req, setup)
    p = setup.precision
    # The engine all-gathers parameters in the compute dtype and reduces gradients in the reduce dtype.
    shape = cm.CommShape(
        params=req.spec.params, num_layers=req.spec.num_layers, param_bytes=p.compute_bytes, grad_bytes=p.reduce_bytes
    )
    accum = setup.grad_accum_steps
    c = cm.step_comm(setup.dims, shape, g, accum, fwd, bwd, req.network, req.overlap, req.sync_every_micro_batch)
    compute = accum * (fwd + bwd)
    step = compute + c.exposed_s
    gpus = setup.gpus
    tokens_step = setup.tokens_per_step
    tps = tokens_step / step
    per_gpu = tps / gpus
    mfu = fl.mfu(req.spec, req.seq_len, per_gpu, req.gpu.peak_tflops(req.compute_dtype))
    budget_t = req.token_budget / tps if req.token_budget else None
    cost = (
        budget_t / 3600 * gpus * req.price_per_gpu_hour
        if budget_t is not None and req.price_per_gpu_hour is not None
        else None
    )
    predicted = Prediction(
        efficiency=eff,
        compute_s=compute,
        comm_total_s=c.total_s,
        comm_exposed_s=c.exposed_s,
        step_time_s=step,
        tokens_per_step=tokens_step,
        tokens_per_s=tps,
        tokens_per_s_per_gpu=per_gpu,
        mfu=mfu,
        memory_per_gpu_bytes=memory_bytes,
        bottleneck=c.bottleneck,
        comm_ops=c.ops,
        budget_time_s=budget_t,
        budget_cost_usd=cost,
    )
    return Candidate(setup, predicted)


def predict(req: PlanRequest, setup: TrainSetup) -> Candidate:
    """One setup timed (`evaluate`) and sized (the memory model, bytes per GPU), whether or not it fits: what
    `llmctl tune` records next to each trial's measurement."""
    return evaluate(req, setup, memory_bytes=mem.estimate(req.spec, setup).device_bytes)
