"""Helpers for the engine tests: tiny plans on the shipped corpus, and real torchrun/python runs of the engine."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "corpus"

# A 2-layer Llama (hidden 64, GQA 4/2 heads) on the shipped corpus: a step takes tens of milliseconds on a CPU.
TINY: dict[str, Any] = {
    "name": "engine-test",
    "model": {
        "preset": "llama-tiny",
        "overrides": {
            "num_hidden_layers": 2,
            "hidden_size": 64,
            "intermediate_size": 172,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    },
    "data": {"kind": "text", "paths": [str(CORPUS)]},
    "hardware": {"nodes": 1, "nproc_per_node": 2},
    "parallel": {"sharding": "full_shard"},
    "training": {
        "precision": "fp32",
        "micro_batch_size": 4,
        "grad_accum_steps": 1,
        "seq_len": 64,
        "max_steps": 30,
        "seed": 0,
        "attention": "auto",
    },
    "optimizer": {"lr": 3e-3, "warmup_steps": 3},
    "logging": {"interval_steps": 1},
}


def deep_update(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def write_plan(folder: Path, over: dict[str, Any] | None = None, ckpt: bool = False) -> Path:
    """A tiny plan in `folder` (logs in folder/logs, checkpoints in folder/ckpt when asked)."""
    plan = deep_update(TINY, over or {})
    plan.setdefault("logging", {})["dir"] = str(folder / "logs")
    if ckpt:
        plan.setdefault("checkpoint", {})["dir"] = str(folder / "ckpt")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def engine_env(tmp: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    scratch = tmp / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        TMPDIR=str(scratch),
        TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("LLMCTL_DEBUG", None)
    env.update(extra or {})
    return env


def engine_cmd(plan: Path, nproc: int) -> list[str]:
    if nproc == 0:  # one plain process, no torchrun
        return [sys.executable, "-m", "llmctl.engine", str(plan)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "llmctl.engine",
        str(plan),
    ]


def run_engine(
    plan: Path, nproc: int, tmp: Path, extra_env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        engine_cmd(plan, nproc),
        cwd=REPO,
        env=engine_env(tmp, extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(plan: Path, event: str | None = None) -> list[dict[str, Any]]:
    path = plan.parent / "logs" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if event is None or r["event"] == event]


def losses(plan: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(plan, "step")}


def check_ok(proc: subprocess.CompletedProcess[str]) -> None:
    err = "\n".join(line for line in proc.stderr.splitlines() if "torch/distributed/run.py" not in line)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{err[-8000:]}"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank FULL run that the loss and resume tests compare against."""
    folder = tmp_path_factory.mktemp("reference")
    plan = write_plan(folder)
    check_ok(run_engine(plan, 2, folder))
    return plan
