"""The planner against what one H200 measured (docs/measurements/h200-gpu-tier.json, the GPU tier on 2026-11-29).

The kernel tables (llmctl/spec/presets/kernels.yaml) were measured on an H100; an H200 is the same Hopper chip with
HBM3e at 4.8 TB/s (the catalog's figure) instead of 3.35. The H200's own kernel measurement
(docs/measurements/h200-kernels.json) shows what that means: matmuls and attention within about 10% of the H100's,
memory-bound ops 1.18-1.41x faster. So the same tables, with the memory-bound ops priced from the catalog's bandwidth,
must predict the H200's runs as they do the H100's: nothing here was fitted to these runs, which came after the
tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.plan.test_measured_h100 import SETUPS, estimate, predicted_run

DOCS = Path(__file__).resolve().parents[2] / "docs/measurements"
H200 = json.loads((DOCS / "h200-gpu-tier.json").read_text())
KERNELS = json.loads((DOCS / "h200-kernels.json").read_text())


@pytest.mark.parametrize("name", [n for n in SETUPS if f"memory/{n}" in H200["results"]])
def test_peak_allocated_within_2_percent_of_the_h200(name: str) -> None:
    got = H200["results"][f"memory/{name}"]
    est = estimate(*SETUPS[name])
    assert est.peak_allocated_bytes / 2**30 == pytest.approx(got["peak_allocated_gib"], rel=0.02)
    assert est.phase_bytes["forward"] / 2**30 == pytest.approx(got["phases_gib"]["forward"], rel=0.05)


FULL = ["speed/bf16-mixed", "speed/1b-8k-bf16-mixed", "speed/1b-32k-bf16-mixed", "speed/3b-bf16-mixed"]


@pytest.mark.parametrize("key", FULL)
def test_full_training_tokens_per_s_within_15_percent_of_the_h200(key: str) -> None:
    """Measured / predicted was 0.89-1.00 when the runs came in (1B and 3B at 2k: 1.00; 1B at 8k 0.89, at 32k 0.94)."""
    ratio, _, _ = predicted_run(key, H200, "H200")
    assert 0.85 < ratio < 1.15, ratio


def test_the_h200_is_priced_faster_than_the_h100_only_where_bandwidth_counts() -> None:
    """The same run planned for both GPUs: the H200's step is shorter by its memory-bound and copy time alone (its
    matmul and attention rates are the H100's), and the measured runs agree in direction."""
    r200, s200, g200 = predicted_run("speed/bf16-mixed", H200, "H200")
    r100, s100, _ = predicted_run("speed/bf16-mixed", H200, "H100-SXM")
    assert s200["matmul"] == pytest.approx(s100["matmul"], rel=0.01)
    assert s200["attention"] == pytest.approx(s100["attention"], rel=0.01)
    assert s200["memory"] < 0.85 * s100["memory"]
    assert r100 > r200  # against the same measured H200 run, the H100's prediction is the slower one


def test_lora_is_over_predicted_on_the_h200_too() -> None:
    """The 1B LoRA run ran at 0.65 of its prediction (the H100's: 0.84): the planner prices GPU work and the LoRA
    step is launch-bound (tests/plan/test_measured_h100.py). Held to a band so a change either way is seen. The run
    had FSDP2 on its one rank, which the engine no longer applies to adapters there (priced without its copies now:
    0.62)."""
    ratio, _, _ = predicted_run("speed/1b-lora-bf16-mixed", H200, "H200")
    assert 0.55 < ratio < 0.85, ratio


def test_the_step_split_against_the_h200_profile() -> None:
    _, split, got = predicted_run("split/1b-2k", H200, "H200")
    m = got["measured_s"]
    assert split["matmul"] == pytest.approx(m["matmul"], rel=0.15)
    assert split["attention"] == pytest.approx(m["attention"], rel=0.25)
    assert all("cudnn" in k["name"] for k in got["top_kernels"] if k["kind"] == "attention")


def test_the_h100_kernel_tables_hold_on_the_h200() -> None:
    """The premise of pricing an H200 with the H100's tables: per kernel, the H200 measured within 12% of them for
    compute (matmuls in bf16, cuDNN and FlashAttention-2 at head dim 64/128), and faster for memory-bound ops by no
    more than the bandwidth ratio 4.8 / 3.35."""
    h100 = json.loads((DOCS / "h100-kernels.json").read_text())

    def gemm(k: dict) -> dict:
        return {(p["shape"], p["dtype"]): p["tflops"] for p in k["gemm"] if "tflops" in p and p["dtype"] == "bf16"}

    def attn(k: dict) -> dict:
        return {
            (p["kernel"], p["head_dim"], p["seq"]): (p["fwd_tflops"], p["bwd_tflops"])
            for p in k["attention"]
            if p["kernel"] in ("sdpa_cudnn", "sdpa_flash") and p["head_dim"] in (64, 128) and "fwd_tflops" in p
        }

    a, b = gemm(h100), gemm(KERNELS)
    ratios = [b[k] / a[k] for k in a if k in b]
    assert len(ratios) >= 10 and all(0.88 < r < 1.12 for r in ratios), ratios
    a, b = attn(h100), attn(KERNELS)
    ratios = [b[k][i] / a[k][i] for k in a if k in b for i in (0, 1)]
    assert len(ratios) >= 40 and all(0.88 < r < 1.12 for r in ratios), ratios
    mem100 = {p["op"]: p["gbytes_s"] for p in h100["memory_bound"]}
    mem200 = {p["op"]: p["gbytes_s"] for p in KERNELS["memory_bound"]}
    ratios = [mem200[op] / mem100[op] for op in mem100]
    assert all(1.15 < r < 4.8 / 3.35 for r in ratios), ratios
