"""Kernel throughput on this machine's GPU: attention by backend, head dimension and sequence length (forward and
backward), matmuls by shape class (bf16 and, where the GPU has it, float8), and memory-bound ops by bytes moved.

`python -m llmctl.measure.kernels -o kernels.json` writes what it measured (the GPU tier runs it, tests/gpu). The
planner's attention and matmul timing is meant to come from such measurements and the kernels' published tables
instead of one efficiency for every kernel (issue 32); this module only measures, it fits nothing.

FLOP conventions (the FlashAttention papers', so their tables and these numbers compare): attention forward =
4 * batch * heads * seq^2 * head_dim, halved when causal; backward = 2.5 x forward (FlashAttention-2, section 4.1).
A matmul (m, k) x (k, n) is 2 m n k. Bandwidth counts bytes read plus bytes written.

Timing: CUDA events around `iters` calls after `warmup` calls, the median of `repeats` such runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmctl.spec.attention import Attention

SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (64, 128, 256)
EAGER_MAX_SEQ = 2048
"""Eager attention (two matmuls around an fp32 softmax, as Hugging Face's eager path) materializes batch x heads x
seq^2 scores: measured up to this length only."""
TOKENS = 16384
"""Tokens per attention call (batch x seq): every point does the same number of query tokens, so the points differ
by sequence length only."""
HIDDEN = 4096
"""Model width of the attention points (heads = HIDDEN / head_dim), Llama-3-8B's."""
GEMMS: dict[str, tuple[int, int, int]] = {
    # (m tokens, k in, n out): Llama-3-8B's projections at 8192 tokens per micro-batch.
    "qkv_8b": (8192, 4096, 6144),
    "o_8b": (8192, 4096, 4096),
    "mlp_up_8b": (8192, 4096, 28672),
    "mlp_down_8b": (8192, 14336, 4096),
    "kv_8b": (8192, 4096, 1024),
    "lm_head_8b": (8192, 4096, 128256),
    # The same layers at tensor-parallel degree 8 (column/row split): the narrow matmuls of TP.
    "qkv_8b_tp8": (8192, 4096, 768),
    "mlp_down_8b_tp8": (8192, 1792, 4096),
    # A 1B model's (Llama-3.2-1B) projections.
    "o_1b": (8192, 2048, 2048),
    "mlp_up_1b": (8192, 2048, 16384),
    # Llama-3.2-3B's (hidden 3072, not a power of two) at 4,096 tokens.
    "qkv_3b": (4096, 3072, 5120),
    "mlp_up_3b": (4096, 3072, 16384),
    "mlp_down_3b": (4096, 8192, 3072),
    # Large square: the GPU's best case.
    "square_8192": (8192, 8192, 8192),
}
GEMM_SWEEP_M = (2048, 8192, 32768)
GEMM_SWEEP_KN = ((512, 4096), (4096, 512), (1024, 1024), (2048, 2048), (2048, 8192), (8192, 2048), (4096, 4096))
"""A grid over the rows (tokens) and the reduction / output widths, bf16 only: what the planner's GEMM efficiency by
shape is checked against (a model's projections sit between these points)."""


def _timer(fn: Callable[[], Any], warmup: int, iters: int, repeats: int) -> float:
    """Median seconds of one call of `fn`."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(runs)


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> float:
    f = 4.0 * batch * heads * seq * seq * head_dim
    return f / 2 if causal else f


def _sdpa_backends() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    return {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def _attention_times(
    kernel: Callable[..., Any], qkv: tuple[Any, ...], grad: Any, fwd_flops: float, warmup: int, iters: int, repeats: int
) -> dict[str, Any]:
    """Forward alone, then forward + backward; backward = the difference."""
    import torch

    def fwd() -> None:
        with torch.no_grad():
            kernel(*qkv)

    def fwd_bwd() -> None:
        torch.autograd.grad(kernel(*qkv), qkv, grad)

    try:
        f_s = _timer(fwd, warmup, iters, repeats)
        b_s = max(_timer(fwd_bwd, warmup, iters, repeats) - f_s, 1e-9)
    except Exception as e:  # noqa: BLE001 - a backend that does not take this shape: recorded as such
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    return {
        "fwd_s": f_s,
        "bwd_s": b_s,
        "fwd_tflops": fwd_flops / f_s / 1e12,
        "bwd_tflops": 2.5 * fwd_flops / b_s / 1e12,
    }


def attention_points(warmup: int = 3, iters: int = 5, repeats: int = 3) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    points: list[dict[str, Any]] = []
    kernels: dict[str, Callable[..., Any]] = {}
    for name, backend in _sdpa_backends().items():

        def run(q: Any, k: Any, v: Any, backend: Any = backend) -> Any:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        kernels[name] = run

    def eager(q: Any, k: Any, v: Any) -> Any:
        s = q.shape[-2]
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        mask = torch.ones(s, s, device=q.device, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

    kernels[Attention.EAGER] = eager
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]

        kernels["flash_attn"] = lambda q, k, v: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True
        )
    except Exception:  # noqa: BLE001 - flash-attn is optional: its points are simply absent
        pass
    for head_dim in HEAD_DIMS:
        heads = HIDDEN // head_dim
        for seq in SEQ_LENS:
            batch = max(1, TOKENS // seq)
            shape = (batch, heads, seq, head_dim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            fwd_flops = attention_flops(batch, heads, seq, head_dim)
            for name, kernel in kernels.items():
                if name == Attention.EAGER and seq > EAGER_MAX_SEQ:
                    continue
                point: dict[str, Any] = {"kernel": name, "head_dim": head_dim, "heads": heads, "seq": seq}
                point["batch"] = batch
                point.update(_attention_times(kernel, (q, k, v), grad, fwd_flops, warmup, iters, repeats))
                points.append(point)
            del q, k, v, grad
    return points


def gemm_points(warmup: int = 5, iters: int = 20, repeats: int = 3) -> list[dict[str, Any]]:
    import torch

    fp8 = torch.cuda.get_device_capability() >= (8, 9) and hasattr(torch, "float8_e4m3fn")
    points: list[dict[str, Any]] = []
    for name, (m, k, n) in GEMMS.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        s = _timer(lambda a=a, b=b: a @ b.t(), warmup, iters, repeats)
        points.append({"shape": name, "m": m, "k": k, "n": n, "dtype": "bf16", "s": s, "tflops": flops / s / 1e12})
        if fp8:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda", dtype=torch.float32)

            def mm8(a8: Any = a8, b8: Any = b8, one: Any = one) -> Any:
                return torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            try:
                s8 = _timer(mm8, warmup, iters, repeats)
                points.append(
                    {"shape": name, "m": m, "k": k, "n": n, "dtype": "fp8", "s": s8, "tflops": flops / s8 / 1e12}
                )
            except Exception as e:  # noqa: BLE001 - a shape _scaled_mm refuses: recorded
                points.append({"shape": name, "dtype": "fp8", "error": f"{type(e).__name__}: {e}"[:200]})
        del a, b
    for m in GEMM_SWEEP_M:
        for k, n in GEMM_SWEEP_KN:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            s = _timer(lambda a=a, b=b: a @ b.t(), warmup, iters, repeats)
            name = f"sweep_m{m}_k{k}_n{n}"
            points.append(
                {"shape": name, "m": m, "k": k, "n": n, "dtype": "bf16", "s": s, "tflops": 2.0 * m * n * k / s / 1e12}
            )
            del a, b
    return points


def memory_points(warmup: int = 3, iters: int = 10, repeats: int = 3) -> list[dict[str, Any]]:
    """Memory-bound ops at Llama-3-8B's width, 8192 tokens: bytes read + written over seconds."""
    import torch
    import torch.nn.functional as F

    tokens, hidden, vocab = 8192, 4096, 128256
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens // 4, vocab, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (tokens // 4,), device="cuda")
    ops: dict[str, tuple[Callable[[], Any], int]] = {
        "copy_512MiB": (lambda: big.clone(), 2 * big.numel() * 2),
        "rms_norm": (lambda: F.rms_norm(x, (hidden,), w), 2 * x.numel() * 2),
        "silu_mul": (lambda: F.silu(x) * x, 3 * x.numel() * 2),
        "cross_entropy_fwd": (lambda: F.cross_entropy(logits.float(), target), logits.numel() * (2 + 4 + 4)),
        "add": (lambda: x + x, 3 * x.numel() * 2),
        "rope": (lambda: rope(x), 0),
    }
    half = hidden // 2
    cos, sin = (
        torch.randn(tokens, half, device="cuda", dtype=torch.bfloat16),
        torch.randn(tokens, half, device="cuda", dtype=torch.bfloat16),
    )

    def rope(t: Any) -> Any:  # Hugging Face's rotate_half form, eager: each read, product and sum its own kernel
        t1, t2 = t[:, :half], t[:, half:]
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)

    # rope's bytes: what its eager kernels read and write (4 products, 2 sums, the concatenation)
    ops["rope"] = (ops["rope"][0], (4 * 3 + 2 * 3 + 2) * tokens * half * 2)
    points = []
    for name, (fn, nbytes) in ops.items():
        try:
            s = _timer(fn, warmup, iters, repeats)
            points.append({"op": name, "bytes": nbytes, "s": s, "gbytes_s": nbytes / s / 1e9})
        except Exception as e:  # noqa: BLE001
            points.append({"op": name, "error": f"{type(e).__name__}: {e}"[:200]})
    return points


def measure() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU on this machine: kernel throughput is measured on a GPU")
    props = torch.cuda.get_device_properties(0)
    t0 = time.time()
    report: dict[str, Any] = {
        "schema": "llmctl.kernels",
        "schema_version": 1,
        "gpu": props.name,
        "capability": list(torch.cuda.get_device_capability()),
        "multiprocessors": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "measured_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "conventions": __doc__.split("FLOP conventions")[1].split("Timing:")[0].strip(),
    }
    report["gemm"] = gemm_points()
    report["attention"] = attention_points()
    report["memory_bound"] = memory_points()
    report["seconds"] = round(time.time() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmctl.measure.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, help="write the JSON here (default: standard output)")
    args = ap.parse_args(argv)
    try:
        report = measure()
    except RuntimeError as e:
        print(f"llmctl: error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=1)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
