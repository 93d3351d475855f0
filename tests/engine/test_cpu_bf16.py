"""The start line of a half-precision run on a CPU (llmctl.engine.cpu_bf16): native bf16 read from /proc/cpuinfo's
flags, a warning naming the cost where the CPU has none."""

from __future__ import annotations

from llmctl.engine.cpu_bf16 import half_precision_line, native_bf16

EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
SAPPHIRE = "flags\t\t: avx512f amx_tile amx_int8 amx_bf16\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


def test_native_bf16_from_the_flags() -> None:
    assert [native_bf16(c) for c in (EPYC, SKYLAKE, SAPPHIRE, GRAVITON3, GRAVITON2)] == [True, False, True, True, False]
    assert native_bf16("processor\t: 0\n") is None  # no flags line: unknown, not "no"
    assert native_bf16("flags\t\t: avx512bf16x\n") is False  # whole words only


def test_a_cpu_without_bf16_gets_a_warning_naming_the_cost() -> None:
    warn, line = half_precision_line("bf16-mixed", "qlora", SKYLAKE)
    assert warn and line.startswith("precision bf16-mixed: this CPU has no bf16 instructions")
    assert "QLoRA dequantizes its 4-bit base to it" in line and "13-17 s a step" in line
    warn, line = half_precision_line("bf16-mixed", "full", GRAVITON2)
    assert warn and "use precision fp32 on this CPU" in line
    warn, line = half_precision_line("fp16-mixed", "lora", "")
    assert warn and "this CPU may lack" in line
    warn, line = half_precision_line("bf16-mixed", "qlora", EPYC)
    assert not warn and "native bf16" in line
