"""What the step's compute is made of and where its rates come from (torch-free): the step split by kind of kernel
that `llmctl plan` prints under the chosen setup, and the basis (each kernel table's source) that `--json` carries."""

from __future__ import annotations

from typing import Any

from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import STEP_KINDS, Candidate
from llmctl.spec import kernels as kt
from llmctl.spec.attention import KERNELS, Attention
from llmctl.spec.models import ModelSpec


def _head_dim(spec: ModelSpec) -> float:
    if spec.measured is not None or not spec.layers:
        return float(spec.head_dim)
    at = spec.layers[0].attention
    return (at.head_dim + at.v_head_dim) / 2


def attention_rates(req: PlanRequest, attention: str, seq: float | None = None) -> tuple[str, str]:
    """(short rate text, basis) of this attention on the request's GPU at its first block's head dimension:
    'fa2 at 340/287 TFLOP/s forward/backward', or eager's memory-bound passes."""
    kernel = kt.kernel_for(attention, req.gpu)
    if Attention(attention).keeps_scores:
        return "eager (score matrix through memory)", (
            f"eager: {kt.EAGER_FWD_BYTES_PER_SCORE}/{kt.EAGER_BWD_BYTES_PER_SCORE} bytes per score element forward/"
            f"backward over {req.gpu.hbm_gbytes_s:,.0f} GB/s x {kt.memory_bound_efficiency():.2f}"
        )
    fwd, bwd, basis = kt.attention_rate(req.gpu, kernel, _head_dim(req.spec), seq or req.seq_len, req.compute_dtype)
    return f"{kernel} at {fwd:.0f}/{bwd:.0f} TFLOP/s forward/backward", basis


def efficiency_basis(req: PlanRequest) -> dict[str, Any]:
    """The rates the prediction used and their sources (`llmctl plan --json`'s `efficiency`)."""
    gpu = req.gpu
    e_max, e_source = kt.gemm_e_max(gpu)
    g = kt.tables().gemm
    attention = {}
    for name in reversed(KERNELS):  # fastest first
        text, basis = attention_rates(req, name)
        attention[name] = {"rate": text, "basis": basis}
    return {
        "matmul_e_max": e_max,
        "matmul_source": e_source,
        "matmul_overhead_s": g.overhead_s,
        "matmul_k_half": g.k_half,
        "matmul_fit_source": g.source,
        "attention": attention,
        "memory_bound_efficiency": kt.memory_bound_efficiency(),
        "memory_bound_source": kt.tables().memory_bound_source,
        "gpu": gpu.efficiency,
        "gpu_source": gpu.efficiency_source,
        "misaligned_penalty": req.efficiency.misaligned_penalty,
        "calibration": req.efficiency.calibration,
    }


def step_split(req: PlanRequest, chosen: Candidate) -> str:
    """'matmuls 3.10 s (55%, at 71% of the bf16 peak for these shapes), attention 1.2 s (21%, fa2 at 340/287 TFLOP/s
    forward/backward, measured on H100-SXM), ...' for the chosen setup, per optimizer step."""
    p, s = chosen.predicted, chosen.setup
    total = sum(p.split.values()) or 1.0
    shard = s.dims.rank_shard(req.seq_len)
    tokens = s.micro_batch_size * req.seq_len // shard.ring_ranks
    eff = req.efficiency.of(tokens, req.spec, req.gpu, req.compute_dtype, shard.tensor_ranks, s.ep)
    rate, basis = attention_rates(req, s.attention, req.seq_len / shard.ring_ranks)
    notes = {
        "matmul": f"at {eff:.0%} of the {req.compute_dtype} peak for these shapes"
        + (" (the experts as grouped GEMMs)" if s.ep > 1 else ""),
        "attention": f"{rate}; {basis}",
        "memory": f"{kt.memory_bound_efficiency():.0%} of {req.gpu.hbm_gbytes_s:,.0f} GB/s"
        + (", fused by torch.compile" if s.compile else ", unfused"),
    }
    parts = []
    for kind, secs in p.split.items():
        if secs <= 0 and kind in ("offload", "comm", "framework"):
            continue
        note = notes.get(kind)
        parts.append(f"{STEP_KINDS[kind]} {secs:.2f} s ({secs / total:.0%}" + (f", {note})" if note else ")"))
    return "; ".join(parts)
