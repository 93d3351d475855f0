"""The measured step split: GPU time by kind of kernel over a few optimizer steps (torch.profiler), to set against
the plan's predicted split (`llmctl plan`'s "step split" line, llmctl.plan.kernel_time).

Set LLMCTL_PROFILE_STEPS=FIRST:LAST (optimizer steps, inclusive; e.g. 4:5, past compilation and the allocator's
growth) on a CUDA run: those steps run under the profiler and `kernel_profile.json` lands next to metrics.jsonl with
the seconds per step by kind (matmul, attention, memory, optimizer, communication, copy), the wall time per step, and
the kernels that took the most time with the kind each was given (the classification is by kernel name: check it
there). On a CPU run the variable is ignored with one line saying why.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from llmctl.errors import InputError

PROFILE_ENV = "LLMCTL_PROFILE_STEPS"
KINDS = {
    # kind: substrings of CUDA kernel names (lower case), first match wins in this order
    "attention": ("flash", "fmha", "attention", "attn"),
    "optimizer": ("multi_tensor_apply", "adam", "foreach"),
    "communication": ("nccl",),
    "matmul": ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_", "ampere_", "_scaled_mm"),
    "copy": ("memcpy", "memset"),
}


def kind_of(name: str) -> str:
    """A CUDA kernel's kind by its name (KINDS); everything else (elementwise, reductions, Triton's fused kernels from
    torch.compile, the loss's softmax) is memory-bound: 'memory'."""
    low = name.lower()
    for kind, keys in KINDS.items():
        if any(k in low for k in keys):
            return kind
    return "memory"


def parse_steps(text: str) -> tuple[int, int]:
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise InputError(f"{PROFILE_ENV} must be FIRST:LAST optimizer steps (e.g. 4:5), got {text!r}") from None
    if first < 1 or last < first:
        raise InputError(f"{PROFILE_ENV}: need 1 <= FIRST <= LAST, got {text!r}")
    return first, last


def device_events(prof: Any) -> list[tuple[str, float]]:
    """(name, seconds) of every device-side event (kernels, copies) the profiler recorded."""
    from torch._C._autograd import DeviceType

    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != DeviceType.CPU:
            out.append((e.name(), e.duration_ns() / 1e9))
    return out


class StepProfiler:
    """Profiles optimizer steps FIRST..LAST (1-based, as the metrics count them) and writes kernel_profile.json."""

    def __init__(self, first: int, last: int, out: Path) -> None:
        self.first, self.last, self.out = first, last, out
        self._prof: Any = None
        self._t0 = 0.0

    @classmethod
    def from_env(cls, log_dir: Path, device_type: str) -> StepProfiler | None:
        text = os.environ.get(PROFILE_ENV)
        if not text:
            return None
        first, last = parse_steps(text)  # a bad value is an error on any machine
        if device_type != "cuda":
            print(f"llmctl: {PROFILE_ENV} ignored: the kernel profile is taken on CUDA runs", file=sys.stderr)
            return None
        return cls(first, last, log_dir / "kernel_profile.json")

    def before(self, step: int) -> None:
        """Called before optimizer step `step` (1-based) runs."""
        if step != self.first:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after(self, step: int, rank: int) -> None:
        if self._prof is None or step != self.last:
            return
        import torch

        torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        steps = self.last - self.first + 1
        by_kind: dict[str, float] = {}
        kernels: dict[str, float] = {}
        for e in device_events(self._prof):
            kernels[e[0]] = kernels.get(e[0], 0.0) + e[1]
        for name, s in kernels.items():
            k = kind_of(name)
            by_kind[k] = by_kind.get(k, 0.0) + s / steps
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
        self._prof = None
        if rank != 0:
            return
        report = {
            "schema": "llmctl.kernel_profile",
            "steps": [self.first, self.last],
            "wall_s_per_step": wall / steps,
            "gpu_s_per_step": by_kind,
            "gpu_total_s_per_step": sum(by_kind.values()),
            "top_kernels": [{"name": n[:160], "kind": kind_of(n), "s_per_step": s / steps} for n, s in top],
        }
        self.out.write_text(json.dumps(report, indent=1) + "\n")
