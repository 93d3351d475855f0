"""The kernel tables (llmctl/spec/presets/kernels.yaml via llmctl.spec.kernels): sources, interpolation, what every
catalog GPU falls back to, the matmul model against the H100 measurement it was fitted to, and eager attention's
memory-bound model against the eager attention the same H100 measured (which it was not fitted to)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llmctl.spec import kernels as kt
from llmctl.spec.hardware import gpu_catalog, resolve_gpu

ROOT = Path(__file__).resolve().parents[2]
MEASURED = json.loads((ROOT / "docs/measurements/h100-kernels.json").read_text())
H100, A100 = resolve_gpu("H100-SXM"), resolve_gpu("A100-80GB")


def test_every_table_names_its_source_and_a_catalog_gpu() -> None:
    t = kt.tables()
    for table in t.attention.values():
        assert len(table.source) > 40 and ("arXiv" in table.source or "docs/measurements/" in table.source)
        assert resolve_gpu(table.gpu).architecture == table.arch
    for value, source in t.gemm.e_max.values():
        assert 0.5 < value < 0.95 and len(source) > 20
    assert "docs/measurements/h100-kernels.json" in t.gemm.source and "h100-kernels.json" in t.memory_bound_source
    assert 0.3 < t.memory_bound_efficiency < 0.9


def test_the_hopper_table_is_the_measurement() -> None:
    """Every point of the table equals docs/measurements/h100-kernels.json's (rounded): no number was tuned."""
    table = kt.tables().attention["hopper"]
    names = {"fa2": "sdpa_flash", "cudnn": "sdpa_cudnn", "efficient": "sdpa_efficient"}
    for kernel, measured_name in names.items():
        for p in MEASURED["attention"]:
            if p["kernel"] != measured_name or "error" in p:
                continue
            i = table.seq.index(p["seq"])
            assert table.kernels[kernel]["fwd"][p["head_dim"]][i] == round(p["fwd_tflops"])
            assert table.kernels[kernel]["bwd"][p["head_dim"]][i] == round(p["bwd_tflops"])


def test_interpolation_is_log_in_length_linear_in_head_dim_and_clamped() -> None:
    rows = kt.tables().attention["hopper"].kernels["fa2"]["fwd"]
    at = lambda d, s: kt.attention_rate(H100, "fa2", d, s)[0]  # noqa: E731
    assert at(128, 8192) == rows[128][3]
    mid = at(128, math.sqrt(4096 * 8192))  # halfway in log(seq)
    assert mid == pytest.approx((rows[128][2] + rows[128][3]) / 2)
    assert at(96, 8192) == pytest.approx((rows[64][3] + rows[128][3]) / 2)
    assert at(128, 100) == rows[128][0] and at(128, 10**7) == rows[128][-1]  # clamped at the ends
    assert at(32, 8192) == rows[64][3] and at(512, 8192) == rows[256][3]


def test_every_catalog_gpu_is_covered_or_says_what_it_falls_back_to() -> None:
    for gpu in gpu_catalog().values():
        kernel = kt.kernel_for("sdpa", gpu)
        dtype = "bf16" if gpu.tflops.get("bf16") else "fp16"
        fwd, bwd, basis = kt.attention_rate(gpu, kernel, 128, 4096, dtype)
        assert bwd > 0 and 0 < fwd < gpu.peak_tflops(dtype)
        own = gpu.architecture in kt.tables().attention and kernel in kt.tables().attention[gpu.architecture].kernels
        assert ("fraction of peak assumed" in basis) != own, (gpu.name, basis)
        e_max, source = kt.gemm_e_max(gpu)
        assert (gpu.architecture in kt.tables().gemm.e_max) != ("assumed" in source and "no matmul" in source)
    # the reference scales by peak: an H100 PCIe (756 TFLOP/s) gets 756/989 of the SXM's numbers
    pcie = resolve_gpu("H100-PCIe")
    assert kt.attention_rate(pcie, "fa2", 128, 4096)[0] == pytest.approx(
        kt.attention_rate(H100, "fa2", 128, 4096)[0] * pcie.peak_tflops("bf16") / H100.peak_tflops("bf16")
    )


def test_which_kernel_each_attention_runs() -> None:
    assert kt.kernel_for("sdpa", H100) == "cudnn" and kt.kernel_for("flash", H100) == "fa2"
    assert kt.kernel_for("sdpa", A100) == "fa2" and kt.kernel_for("eager", A100) == "eager"
    assert kt.kernel_for("sdpa", resolve_gpu("V100-16GB")) == "efficient"  # no FlashAttention-2 on Volta


def test_matmul_model_is_within_a_fifth_of_every_measured_h100_matmul() -> None:
    """The fit's own data (kernel measurements, not training runs): every bf16 point within 20%, the median within
    6%; small and shallow matmuls are slower than large ones."""
    errors = []
    for p in MEASURED["gemm"]:
        if p.get("dtype") != "bf16" or "error" in p:
            continue
        predicted = kt.gemm_seconds(H100, p["m"], p["k"], p["n"], H100.peak_tflops("bf16"))
        errors.append(abs(math.log(predicted / p["s"])))
    errors.sort()
    assert len(errors) >= 30 and errors[-1] < math.log(1.2) and errors[len(errors) // 2] < math.log(1.06)
    big = kt.gemm_seconds(H100, 8192, 4096, 4096, 989.4)
    assert kt.gemm_seconds(H100, 8192, 512, 4096, 989.4) * 8 > big  # k = 512 runs below k = 4096's rate
    assert kt.gemm_seconds(H100, 1024, 4096, 4096, 989.4) * 8 > big  # so do few rows


def test_eager_attention_as_memory_passes_matches_the_measured_eager_kernel() -> None:
    """EAGER_*_BYTES_PER_SCORE are counted from transformers' eager path, not fitted: against the H100's measured
    eager attention (scores in fp32 softmax) they land within 35% at every head dimension and length measured."""
    for p in MEASURED["attention"]:
        if p["kernel"] != "eager" or "error" in p:
            continue
        f, b = kt.eager_seconds(H100, p["heads"] * p["batch"], p["seq"], p["seq"], p["head_dim"], 989.4)
        assert f == pytest.approx(p["fwd_s"], rel=0.35) and b == pytest.approx(p["bwd_s"], rel=0.35), p


def test_a_bad_table_is_refused_with_its_name() -> None:
    with pytest.raises(Exception, match="seq must be increasing"):
        kt._table({"arch": "x", "gpu": "H100", "source": "s", "seq": [2, 1], "kernels": {}})
    with pytest.raises(Exception, match="unknown attention kernel 'fa9'"):
        kt._table({"arch": "x", "gpu": "H100", "source": "s", "seq": [1, 2], "kernels": {"fa9": {}}})
    with pytest.raises(Exception, match="one positive rate per seq"):
        kt._table(
            {
                "arch": "x",
                "gpu": "H100",
                "source": "s",
                "seq": [1, 2],
                "kernels": {"fa2": {"fwd": {64: [1]}, "bwd": {}}},
            }
        )


def test_the_ampere_table_is_derived_from_the_paper_panel_as_its_source_says() -> None:
    """FlashAttention-2 paper fig. 4(c) (A100, causal, head dim 64, forward + backward): 88 ... 171 TFLOP/s. Each A100
    row is that panel split into forward and backward, and carried to head dims 128 and 256, by the H100 table's
    ratios at the same length (512 takes 1k's): recomputed here, within rounding."""
    panel = dict(zip((512, 1024, 2048, 4096, 8192, 16384), (88, 119, 140, 156, 165, 171)))
    hop, amp = kt.tables().attention["hopper"], kt.tables().attention["ampere"]
    h = hop.kernels["fa2"]

    def combined(f: float, b: float) -> float:  # the panel's forward + backward rate (3.5 x forward FLOPs)
        return 3.5 / (1 / f + 2.5 / b)

    for j, seq in enumerate(amp.seq):
        i = hop.seq.index(max(seq, hop.seq[0]))
        for d in (64, 128, 256):
            f, b = h["fwd"][d][i], h["bwd"][d][i]
            rate = panel[seq] * combined(f, b) / combined(h["fwd"][64][i], h["bwd"][64][i])
            fwd = rate * (1 + 2.5 * f / b) / 3.5
            assert amp.kernels["fa2"]["fwd"][d][j] == pytest.approx(fwd, abs=1)
            assert amp.kernels["fa2"]["bwd"][d][j] == pytest.approx(fwd * b / f, abs=1)
            # the paper: up to 73% of A100's 312 TFLOP/s forward, 63% backward
            assert amp.kernels["fa2"]["fwd"][d][j] <= 0.73 * 312 and amp.kernels["fa2"]["bwd"][d][j] <= 0.63 * 312
