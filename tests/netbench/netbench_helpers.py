"""Helpers shared by the bench-net tests (a uniquely named module: other test folders have their own conftest)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NETNS_SH = REPO / "scripts" / "netns.sh"
LLMCTL = [sys.executable, "-m", "llmctl.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment for a bench-net subprocess: one thread per rank, torchrun's litter in tmp_path."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1", **extra)
    env.pop("LLMCTL_DEBUG", None)
    return env
