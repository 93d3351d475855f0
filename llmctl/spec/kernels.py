"""Kernel timing as data (presets/kernels.yaml, each table with its source): attention throughput by GPU
architecture, kernel, head dimension and sequence length, forward and backward; matmul time by shape; eager
attention's memory-bound score passes; the elementwise kernels' share of HBM bandwidth. Torch-free.

The planner (llmctl.plan.timing) sums these per micro-batch: matmuls at their shape's rate, attention at its kernel's,
memory-bound ops as bytes over bandwidth. A GPU whose architecture has no table of its own uses the reference
architecture's fraction of peak (its numbers scaled by the ratio of the two peaks), and `attention_rate` /
`gemm_e_max` say so in their `basis`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from llmctl.errors import SpecError
from llmctl.spec.attention import Attention
from llmctl.spec.hardware import GPUSpec, resolve_gpu

REFERENCE_ARCH = "hopper"
"""The architecture measured here (docs/measurements/h100-kernels.json): what a GPU without its own table falls back
to, as a fraction of its peak."""
KERNELS = ("fa2", "cudnn", "efficient")
FA_BACKWARD_FLOPS = 2.5
"""Backward attention FLOPs over forward, as the FlashAttention papers count them (FlashAttention-2, arXiv
2307.08691, section 4.1: five matmuls in backward against two in forward)."""
EAGER_FWD_BYTES_PER_SCORE = 24
"""Hugging Face's eager attention (transformers' eager_attention_forward) per element of the b x heads x s x s score
matrix, forward: QK^T writes it in bf16 (2), the scaling reads and writes it (4), the causal mask's addition reads and
writes it (4, the mask broadcast over heads stays in cache), softmax in fp32 reads bf16 and writes fp32 (6), the cast
back reads fp32 and writes bf16 (6), the product with V reads it (2). Checked against eager attention measured on an
H100 (tests/spec/test_kernels.py): 9, 17 and 33 TFLOP/s at head dim 64, 128 and 256."""
EAGER_BWD_BYTES_PER_SCORE = 36
"""The same matrix's backward: the gradient of the V product written (2) and read by the cast's backward (2 -> 4:
6), softmax's backward reads its fp32 output and the gradient and writes one (12), the cast to bf16 (6), the mask and
scaling backward read and write (4 + 4), QK^T's two gradient products read it (4)."""


@dataclass(frozen=True)
class AttentionTable:
    arch: str
    gpu: str
    source: str
    seq: tuple[int, ...]
    kernels: dict[str, dict[str, dict[int, tuple[float, ...]]]]
    """kernel -> 'fwd'/'bwd' -> head dim -> TFLOP/s per seq."""


@dataclass(frozen=True)
class Gemm:
    overhead_s: float
    k_half: float
    source: str
    e_max: dict[str, tuple[float, str]]


@dataclass(frozen=True)
class Tables:
    attention: dict[str, AttentionTable]
    gemm: Gemm
    memory_bound_efficiency: float
    memory_bound_source: str


def _table(raw: dict[str, Any]) -> AttentionTable:
    seq = tuple(int(s) for s in raw["seq"])
    if list(seq) != sorted(seq) or len(seq) < 2:
        raise SpecError(f"kernels.yaml: {raw.get('arch')}: seq must be increasing, 2 or more points")
    kernels: dict[str, dict[str, dict[int, tuple[float, ...]]]] = {}
    for name, dirs in raw["kernels"].items():
        if name not in KERNELS:
            raise SpecError(f"kernels.yaml: unknown attention kernel {name!r} (known: {', '.join(KERNELS)})")
        kernels[name] = {}
        for d in ("fwd", "bwd"):
            rows = {int(h): tuple(float(v) for v in vals) for h, vals in dirs[d].items()}
            if any(len(v) != len(seq) or min(v) <= 0 for v in rows.values()):
                raise SpecError(f"kernels.yaml: {raw['arch']} {name} {d}: one positive rate per seq")
            kernels[name][d] = rows
    return AttentionTable(raw["arch"], raw["gpu"], raw["source"], seq, kernels)


@lru_cache(maxsize=1)
def tables() -> Tables:
    raw = yaml.safe_load(resources.files("llmctl.spec").joinpath("presets/kernels.yaml").read_text())
    g = raw["gemm"]
    return Tables(
        attention={t["arch"]: _table(t) for t in raw["attention"]},
        gemm=Gemm(
            overhead_s=float(g["overhead_s"]),
            k_half=float(g["k_half"]),
            source=g["source"],
            e_max={a: (float(v["value"]), v["source"]) for a, v in g["e_max"].items()},
        ),
        memory_bound_efficiency=float(raw["memory_bound_efficiency"]["value"]),
        memory_bound_source=raw["memory_bound_efficiency"]["source"],
    )


def memory_bound_efficiency() -> float:
    return tables().memory_bound_efficiency


SDPA_CUDNN_ARCHS = ("hopper", "blackwell")
"""Where PyTorch's SDPA runs cuDNN's attention for bf16/fp16 causal attention: a profile of the engine on an H100
(torch 2.11, docs/measurements/h100-gpu-tier.json, split/*: every attention kernel was
cudnn_generated_fort_native_sdpa_sm90_flash_*), PyTorch's backend order putting cuDNN first on sm90 and newer."""


ARCH_BY_CAPABILITY = {7: "volta", 8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}
"""CUDA compute capability (major) -> the catalog's architecture (presets/gpus.yaml); 7.5 is Turing and 8.9 Ada
(ARCH_BY_CAPABILITY_MINOR), which share a major with another generation (NVIDIA's CUDA GPUs list)."""
ARCH_BY_CAPABILITY_MINOR = {(7, 5): "turing", (8, 9): "ada"}


def architecture_of(capability: tuple[int, int]) -> str:
    """The catalog architecture of a CUDA device from its compute capability ('unknown' for one not listed)."""
    return ARCH_BY_CAPABILITY_MINOR.get(capability) or ARCH_BY_CAPABILITY.get(capability[0], "unknown")


def sdpa_kernel(architecture: str, flash_attention: bool) -> str:
    """The kernel SDPA is priced at, and the engine asks for first, on a GPU of this architecture: cuDNN's attention on
    Hopper and Blackwell (SDPA_CUDNN_ARCHS), FlashAttention-2 on the other GPUs it runs on (sm80+), the
    memory-efficient kernel elsewhere. One rule for the planner (kernel_for) and the engine (llmctl.engine.sdpa)."""
    if not flash_attention:
        return "efficient"
    return "cudnn" if architecture in SDPA_CUDNN_ARCHS else "fa2"


def kernel_for(attention: str, gpu: GPUSpec) -> str:
    """The kernel a plan's attention runs on this GPU: flash-attn is FlashAttention-2; SDPA as `sdpa_kernel` says;
    memory-efficient where FlashAttention-2 does not run (Volta, Turing); eager is eager."""
    kind = Attention(attention)
    if kind.keeps_scores:
        return "eager"
    if not gpu.flash_attention:
        return "efficient"
    if kind is Attention.SDPA:
        return sdpa_kernel(gpu.architecture, gpu.flash_attention)
    return "fa2"


def _interp(xs: tuple[float, ...] | list[float], ys: tuple[float, ...] | list[float], x: float, log: bool) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x) - 1
    x0, x1 = xs[i], xs[i + 1]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if log else (x - x0) / (x1 - x0)
    return ys[i] + t * (ys[i + 1] - ys[i])


def _lookup(table: AttentionTable, kernel: str, direction: str, head_dim: float, seq: float) -> float:
    rows = table.kernels[kernel][direction]
    dims = sorted(rows)
    by_dim = [_interp(table.seq, rows[d], seq, log=True) for d in dims]
    return _interp(dims, by_dim, head_dim, log=False)


def attention_rate(
    gpu: GPUSpec, kernel: str, head_dim: float, seq: float, dtype: str = "bf16"
) -> tuple[float, float, str]:
    """(forward, backward) TFLOP/s of causal attention (FlashAttention convention) and the basis of the numbers: this
    architecture's table, or the reference one's fraction of peak scaled to this GPU's `dtype` peak, said so."""
    return _attention_rate(gpu.architecture, gpu.peak_tflops(dtype), kernel, float(head_dim), float(seq))


@lru_cache(maxsize=4096)
def _attention_rate(arch: str, peak: float, kernel: str, head_dim: float, seq: float) -> tuple[float, float, str]:
    t = tables().attention
    table = t.get(arch)
    basis = ""
    if table is None or kernel not in table.kernels:
        table = t[REFERENCE_ARCH]
        basis = f"no {kernel} table for {arch}: {table.arch}'s fraction of peak assumed; "
    scale = peak / resolve_gpu(table.gpu).peak_tflops("bf16")
    fwd = _lookup(table, kernel, "fwd", head_dim, seq) * scale
    bwd = _lookup(table, kernel, "bwd", head_dim, seq) * scale
    basis += f"{kernel} from the {table.arch} table ({table.gpu})" + (
        f", x{scale:.2f} by peak" if abs(scale - 1) > 1e-9 else ""
    )
    return fwd, bwd, basis


def gemm_e_max(gpu: GPUSpec) -> tuple[float, str]:
    """The fraction of peak a large matmul reaches on this GPU's architecture, and its source (or the fallback)."""
    g = tables().gemm
    if gpu.architecture in g.e_max:
        return g.e_max[gpu.architecture]
    value, _ = g.e_max[REFERENCE_ARCH]
    return value, f"no matmul measurement for {gpu.architecture}: {REFERENCE_ARCH}'s {value:.2f} of peak assumed"


def gemm_seconds(gpu: GPUSpec, m: float, k: float, n: float, peak_tflops: float) -> float:
    """Seconds of one (m x k) @ (k x n) matmul at `peak_tflops` (the dtype's dense peak)."""
    g = tables().gemm
    e = gemm_e_max(gpu)[0] * k / (k + g.k_half)
    return 2.0 * m * k * n / (e * peak_tflops * 1e12) + g.overhead_s


def eager_seconds(
    gpu: GPUSpec, heads: int, queries: float, span: float, head_dim: float, peak_tflops: float
) -> tuple[float, float]:
    """(forward, backward) seconds of eager attention over `heads` heads of `queries` query rows, each scoring `span`
    keys: the score matrix's passes through HBM (EAGER_*) plus its two matmuls (QK^T and AV; four in backward) at the
    matmul rate."""
    bw = gpu.hbm_gbytes_s * 1e9 * memory_bound_efficiency()
    scores = heads * queries * span
    mm = 2 * 2 * scores * head_dim / (gemm_e_max(gpu)[0] * peak_tflops * 1e12)
    return scores * EAGER_FWD_BYTES_PER_SCORE / bw + mm, scores * EAGER_BWD_BYTES_PER_SCORE / bw + 2 * mm
