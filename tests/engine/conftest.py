"""Helpers for the engine tests: tiny plans on the shipped corpus, and real torchrun/python runs of the engine."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "corpus"
ENGINE_RUNS = REPO / "tests" / "engine" / "engine_runs.py"

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


def torchrun_cmd(script: Path, args: list[str], nproc: int) -> list[str]:
    """`torchrun --standalone --nproc_per_node NPROC SCRIPT ARGS...`: a test harness on real gloo ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)]
    return [*cmd, *args]


HEAP_ABORT = re.compile(
    r"^(malloc\(\)|free\(\)|realloc\(\)|munmap_chunk\(\)|malloc_consolidate\(\)|double free or corruption|corrupted size)"
    r"[^\n]*",
    re.M,
)
"""glibc's own abort message for a corrupted heap (e.g. "malloc(): unaligned tcache chunk detected")."""


def torchrun_script(
    script: Path, args: list[str], nproc: int, tmp: Path, extra_env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """One torchrun of `script`. Run again once, with a warning in pytest's summary, when a rank died of glibc's
    heap-corruption abort: seen once in CI (2026-11-27, the 4-rank TP/CP launch, rank 1, "malloc(): unaligned tcache
    chunk detected") and in none of 6 reruns, a fault inside torch/gloo on CPU ranks, not in what the tests check. A
    crash that comes back fails as before."""
    for attempt in (1, 2):
        proc = subprocess.run(
            torchrun_cmd(script, args, nproc),
            cwd=REPO,
            env=engine_env(tmp, extra_env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        abort = HEAP_ABORT.search(proc.stdout + proc.stderr)
        if proc.returncode == 0 or abort is None or attempt == 2:
            return proc
        warnings.warn(f"{script.name}: a rank aborted ({abort.group(0)}); the launch is run once more", stacklevel=2)
    return proc


def read_results(out: Path) -> dict[str, Any]:
    """What a harness launch wrote (nothing when it failed before writing)."""
    return json.loads(out.read_text()) if out.exists() else {}


def plan_runs(
    proc: subprocess.CompletedProcess[str], results: dict[str, Any], plans: list[Path]
) -> dict[Path, subprocess.CompletedProcess[str]]:
    """Each plan's run in a launch of tests/engine/engine_runs.py (`results`: what it wrote), as a CompletedProcess:
    the exit code of the engine's main (the launch's, or 1, for a plan it did not finish) and, as stderr, the
    engine's log messages on rank 0 during that run alone (the launch's stdout and stderr added when it failed)."""
    out = {}
    for plan in plans:
        got = results.get(str(plan))
        if got is None:
            stderr = f"{plan}: not run to its end in the launch\n{proc.stderr}"
            out[plan] = subprocess.CompletedProcess(proc.args, proc.returncode or 1, proc.stdout, stderr)
            continue
        stderr = "\n".join(got["log"])
        if got["code"] != 0:
            stderr += "\n" + proc.stderr
        out[plan] = subprocess.CompletedProcess(proc.args, got["code"], proc.stdout if got["code"] else "", stderr)
    return out


def run_engine_plans(
    plans: list[Path], nproc: int, tmp: Path, extra_env: dict[str, str] | None = None, timeout: float = 600
) -> dict[Path, subprocess.CompletedProcess[str]]:
    """Run `plans` one after the other through the engine's entry point in ONE torchrun of NPROC ranks
    (tests/engine/engine_runs.py: a torchrun costs ~10 s of CPU, a tiny plan about a second); per plan, a
    CompletedProcess for check_ok and the engine's log messages (plan_runs)."""
    out = tmp / "engine-runs.json"
    out.unlink(missing_ok=True)
    proc = torchrun_script(ENGINE_RUNS, [str(out), *map(str, plans)], nproc, tmp, extra_env, timeout)
    return plan_runs(proc, read_results(out), plans)


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


# The one launch of every tensor- and context-parallel case, shared by their test modules (session-scoped: a fixture
# defined here runs once for the session, where one imported into two test modules would run twice).
from tests.engine.parallel_runs import parallel_cases  # noqa: E402, F401
