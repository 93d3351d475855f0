"""What the GPU tier's machinery does on a machine without CUDA (this one and CI's): `make test-gpu` says in one line
why nothing ran and succeeds, the kernel measurement refuses in one line, and the engine's per-phase memory peaks
(llmctl.engine.metrics.PhasePeaks) keep the whole run's peak across the allocator resets, checked on a fake
allocator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmctl.engine import metrics

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: tests/gpu runs instead")


def test_make_test_gpu_says_why_nothing_ran_and_succeeds() -> None:
    p = subprocess.run(
        ["bash", "scripts/test-gpu.sh"],
        cwd=REPO,
        env={**os.environ, "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines() == [
        f"test-gpu: nothing ran: no CUDA GPU on this machine (torch {torch.__version__}, built for CUDA None)"
    ]


def test_the_kernel_measurement_needs_a_gpu() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "llmctl.measure.kernels"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "llmctl: error: no CUDA GPU on this machine: kernel throughput is measured on a GPU"
    ]


class FakeAllocator:
    """torch.cuda's peak counters: a peak since the last reset, and the current allocation."""

    def __init__(self) -> None:
        self.now = self.peak = self.reserved = self.peak_reserved = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)
        self.reserved = max(self.reserved, self.now)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def reset(self) -> None:
        self.peak, self.peak_reserved = self.now, self.reserved


def test_phase_peaks_keep_each_phase_and_the_run_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: fake.peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: fake.peak_reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": 2})
    peaks = metrics.PhasePeaks(True)
    for _ in range(2):  # two steps: forward up to 100, backward up to 160, optimizer up to 60
        fake.alloc(100)
        peaks.mark("forward")
        fake.alloc(60)
        fake.alloc(-140)
        peaks.mark("backward")
        fake.alloc(40)
        fake.alloc(-60)
        peaks.mark("optimizer")
    # after the resets the allocator alone has forgotten the backward's 160: the phases keep it
    assert fake.peak == 0
    got = metrics.peak_memory("cuda", peaks)
    assert got["peak_mem_phase_bytes"] == {"forward": 100, "backward": 160, "optimizer": 60}
    assert got["peak_mem_allocated_bytes"] == 160 and got["peak_mem_reserved_bytes"] == 160
    assert got["alloc_retries"] == 2
    assert metrics.peak_memory("cuda")["peak_mem_phase_bytes"] is None  # no phases read: the allocator's own peak


def test_phase_peaks_are_off_on_a_cpu() -> None:
    peaks = metrics.PhasePeaks(False)
    peaks.mark("forward")  # no torch.cuda call on a machine without it
    assert peaks.allocated == {"forward": 0, "backward": 0, "optimizer": 0}
    got = metrics.peak_memory("cpu", peaks)
    assert got["peak_rss_bytes"] > 0 and "peak_mem_phase_bytes" not in got


def test_the_core_tier_is_its_first_cases_in_order() -> None:
    """LLMCTL_GPU_TIER=core collects exactly tests/gpu/conftest.py's CORE, in its order (each name a real case: a
    renamed test would drop out of the core silently), and the whole tier starts with them."""
    from tests.gpu.conftest import CORE

    def ids(env: dict[str, str]) -> list[str]:
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/gpu", "--co", "-q", "-p", "no:cacheprovider"],
            cwd=REPO,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        return [line.split("::", 1)[1] for line in p.stdout.splitlines() if "::" in line]

    core = ids({"LLMCTL_GPU_TIER": "core"})
    assert core == list(CORE)
    whole = ids({"LLMCTL_GPU_TIER": ""})
    assert whole[: len(CORE)] == list(CORE) and len(whole) > len(CORE)
