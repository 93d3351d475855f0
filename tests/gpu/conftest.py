"""The GPU tier (`make test-gpu`, `pytest -m gpu`): every test here needs CUDA. On a machine without it each one is
collected and skipped with the reason; `make test` never depends on them.

The tier's figures (kernel throughput, estimate vs allocator, measured vs planned tokens/s) go to one JSON report:
`report.json` in the tier's run folder ($LLMCTL_GPU_RUN_DIR, default runs/gpu-tier in the repository), written after
every test so that a tier cut short still leaves what it measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def cuda_gpus() -> tuple[int, str]:
    """(number of CUDA GPUs, why none) without initialising CUDA in the test process's parent state for long."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, f"no CUDA GPU on this machine (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    return torch.cuda.device_count(), ""


CORE = (
    "test_tiny_run_bf16_compiled_through_launch",
    "test_fp16_loss_scaling_skips_an_overflowed_step",
    "test_float8_tiny_run",
    "test_memory_estimate_against_the_allocator[mb8-none]",
    "test_measured_tokens_per_s_against_the_plan[bf16-mixed]",
    "test_measured_tokens_per_s_against_the_plan[fp8-tensorwise]",
    "test_memory_estimate_against_the_allocator[mb8-full]",
    "test_step_split_against_the_plan[1b-2k]",
    "test_measured_tokens_per_s_against_the_plan[1b-lora-bf16-mixed]",
    "test_kernel_throughput",
)
"""The tier's first cases, most telling first: the engine on CUDA + NCCL, then one memory, speed and split check each.
On one H200 (2026-11-29) they took 40, 14, -, 40, 40, -, 36, 45, 40 and 74 s (float8 skipped: no torchao): about 6
minutes, so a 15-minute device lease runs them with room for a rerun. LLMCTL_GPU_TIER=core runs only these; the
whole tier (about 16 minutes on that GPU) runs them first, so a tier cut short still has them."""


def tier_order(items: list[pytest.Item], core_only: bool) -> list[pytest.Item]:
    """CORE first in its order, then the rest as collected; only CORE with `core_only`."""
    rank = {name: i for i, name in enumerate(CORE)}
    first = sorted((i for i in items if i.name in rank), key=lambda i: rank[i.name])
    return first if core_only else first + [i for i in items if i.name not in rank]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    n, why = cuda_gpus()
    tier = [i for i in items if Path(str(i.fspath)).is_relative_to(here)]
    if tier:
        ordered = tier_order(tier, os.environ.get("LLMCTL_GPU_TIER") == "core")
        others = [i for i in items if i not in tier]
        if len(ordered) < len(tier):
            config.hook.pytest_deselected(items=[i for i in tier if i not in ordered])
        items[:] = ordered + others
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.gpu)
            if not n:
                item.add_marker(pytest.mark.skip(reason=f"GPU tier: {why}"))


@pytest.fixture(scope="session")
def run_dir() -> Path:
    d = Path(os.environ.get("LLMCTL_GPU_RUN_DIR", REPO / "runs" / "gpu-tier"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="session")
def report(run_dir: Path) -> dict[str, Any]:
    """What the tier measured, by test; written to run_dir/report.json whenever a test adds to it (record())."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "schema": "llmctl.gpu-tier",
        "gpu": props.name,
        "gpus": torch.cuda.device_count(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": {},
        "_path": str(run_dir / "report.json"),
    }


def record(report: dict[str, Any], key: str, value: Any) -> None:
    report["results"][key] = value
    path = Path(report["_path"])
    path.write_text(json.dumps({k: v for k, v in report.items() if k != "_path"}, indent=1) + "\n")


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH", "")) if p)
    e.pop("LLMCTL_DEBUG", None)
    return e


def run(args: list[str], timeout: float, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python ARGS...` in the repository, output captured; a failure shows its output in the assertion."""
    p = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, f"{' '.join(args[:4])}... exited {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    return p


def events(metrics: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == kind]


def flash_attn_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
