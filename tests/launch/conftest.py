"""Fixtures for the launch tests. `slurm_cluster` starts a real single-host SLURM (3 fake nodes) for the session
with scripts/slurm-up.sh and always stops it with scripts/slurm-down.sh, even when a test fails.

Skips with the reason when not root or when SLURM cannot be installed/started; with CI=true it fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # for launch_helpers (tests run with --import-mode=importlib)

from launch_helpers import REPO  # noqa: E402

SLURM_DIR = "/tmp/llmctl-slurm-tests"
SLURM_PORT = "6937"  # not the default 6817, nor slurm-up's 6917: a dev cluster may run beside the tests
NODES = "3"  # 2-node jobs, and the preflight's 2 + 1 spare (tests/launch/test_preflight_slurm.py)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but the real SLURM is unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        _unavailable("SLURM tests need root (they start slurmctld, slurmd and munged)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        _unavailable("SLURM is not installed and there is no apt-get to install it")
    env = {**os.environ, "LLMCTL_SLURM_DIR": SLURM_DIR, "LLMCTL_SLURM_PORT": SLURM_PORT, "LLMCTL_SLURM_NODES": NODES}
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "LLMCTL_SLURM_DIR")}
    try:
        up = subprocess.run(
            ["bash", str(REPO / "scripts" / "slurm-up.sh")], env=env, capture_output=True, text=True, timeout=300
        )
        if up.returncode != 0:
            _unavailable(f"scripts/slurm-up.sh failed: {(up.stderr or up.stdout).strip().splitlines()[-1:]}")
        os.environ["SLURM_CONF"] = f"{SLURM_DIR}/etc/slurm.conf"
        os.environ["LLMCTL_SLURM_DIR"] = SLURM_DIR
        yield {"SLURM_CONF": os.environ["SLURM_CONF"], "dir": SLURM_DIR}
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "slurm-down.sh")], env=env, capture_output=True, timeout=120)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
