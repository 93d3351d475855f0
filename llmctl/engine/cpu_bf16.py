"""Whether this CPU computes bf16 natively, and the start line that says so (torch-free).

A half compute dtype on a CPU (bf16-mixed or fp16-mixed: QLoRA needs one, its 4-bit base is dequantized to it) runs
its matmuls on the CPU's bf16 instructions where it has them (x86: AVX512-BF16, AMX; Arm: the BF16 extension) and in
software otherwise. The difference is large: the shipped QLoRA example (examples/qlora-cpu.yaml) took 0.41 s a step
on an AMD EPYC with avx512_bf16 and 13-17 s on a CPU without (issue 47's report). fp32 has no such cliff, which is
why the CPU examples train in fp32 except QLoRA.
"""

from __future__ import annotations

from pathlib import Path

NATIVE_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags of native bf16 arithmetic: x86's `flags` (avx512_bf16, amx_bf16), Arm's `Features` (bf16)."""


def native_bf16(cpuinfo: str | None = None) -> bool | None:
    """True/False from /proc/cpuinfo's flags (or the text given); None where it cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    words: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            words.update(value.split())
    if not words:
        return None
    return any(f in words for f in NATIVE_FLAGS)


def half_precision_line(precision: str, method: str, cpuinfo: str | None = None) -> tuple[bool, str]:
    """(is it a warning, the line) for a run in `precision` (a half compute dtype) on this CPU, fine-tune `method`."""
    native = native_bf16(cpuinfo)
    if native:
        return False, f"precision {precision} on a CPU with native bf16 instructions (avx512_bf16, AMX or Arm BF16)"
    what = "has no" if native is False else "may lack"
    why = "QLoRA dequantizes its 4-bit base to it" if method == "qlora" else "use precision fp32 on this CPU"
    return True, (
        f"precision {precision}: this CPU {what} bf16 instructions (avx512_bf16, AMX or Arm BF16), so its half-precision "
        f"matmuls run in software, tens of times slower than fp32 ({why}; the QLoRA example took 13-17 s a step on "
        "such a CPU, 0.41 s with avx512_bf16)"
    )
