"""Shared bits for the launch tests (not a test module)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_PLAN = REPO / "examples" / "tiny-cpu.yaml"
CORPUS = REPO / "examples" / "corpus" / "stdlib-docstrings.txt"

# Names and paths that try every way out of a shell word: quotes, ;, $(), backticks, newlines.
HOSTILE = 'it\'s "x"; $(touch PWNED1) `touch PWNED2`\n touch PWNED3 & echo \\ $HOME %j'


def write_stub(folder: Path, name: str, body: str) -> Path:
    """An executable stub command (bash) in folder."""
    p = folder / name
    p.write_text("#!/bin/bash\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return p


def pwned(*roots: Path) -> list[Path]:
    return [p for r in roots for p in r.rglob("PWNED*")]


def minimal_plan_yaml(name: str = "tiny", nodes: int = 1, nproc: int = 2) -> str:
    return (
        f"version: 1\nname: {json.dumps(name)}\nmodel:\n  preset: llama-tiny\n"
        f"hardware:\n  nodes: {nodes}\n  nproc_per_node: {nproc}\n"
        "training:\n  max_steps: 3\n  precision: fp32\n  seq_len: 32\n"
        # A plan that launch runs: real data and a checkpoint folder (a synthetic or checkpoint-less plan is refused
        # without --allow-synthetic / --allow-no-checkpoint).
        f"data:\n  kind: text\n  paths: [{json.dumps(str(CORPUS))}]\n"
        "checkpoint:\n  dir: checkpoints\n"
    )


def env_without_slurm() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def job_env(job_dir: Path, **more: str) -> dict[str, str]:
    """What templates/slurm.sbatch.j2 exports and SLURM sets for the preflight (job 42, first run)."""
    return {
        "LLMCTL_JOB_DIR": str(job_dir),
        "LLMCTL_PLAN": str(job_dir / "plan.yaml"),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "LLMCTL_RDZV_PORT": "29542",
        **more,
    }
