"""Local launch: one `torchrun --standalone` on this machine running `python -m llmctl.engine PLAN`. Torch-free."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from llmctl.errors import InputError, RuntimeFailure

ENGINE_MODULE = "llmctl.engine"


def torchrun_command() -> list[str]:
    """torchrun of the Python that runs llmctl (a venv's own), else the one on PATH, else `python -m`."""
    beside = Path(sys.executable).with_name("torchrun")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def visible_gpus() -> int:
    """GPUs this process may use, without importing torch (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def resolve_nproc(requested: str | None, plan_nproc: int) -> int:
    """--nproc-per-node: None -> the plan's value; 'auto' -> the GPUs present (1 on a CPU-only machine)."""
    if requested is None:
        return plan_nproc
    if requested == "auto":
        return max(1, visible_gpus())
    try:
        n = int(requested)
    except ValueError:
        raise InputError(f"--nproc-per-node {requested!r}: expected a positive integer or 'auto'") from None
    if n < 1:
        raise InputError(f"--nproc-per-node {n}: must be at least 1")
    return n


def torchrun_argv(plan_path: str | os.PathLike[str], nproc_per_node: int) -> list[str]:
    """The exact local command: single node, standalone rendezvous (torchrun picks a free port)."""
    return [
        *torchrun_command(),
        "--standalone",
        "--nnodes=1",
        f"--nproc_per_node={nproc_per_node}",
        "--module",
        ENGINE_MODULE,
        str(plan_path),
    ]


def run(argv: list[str]) -> int:
    """Run the command with this terminal's stdout/stderr (the engine's progress streams through) and return
    its exit code. Ctrl-C reaches torchrun through the terminal's process group; we only wait for it."""
    try:
        proc = subprocess.Popen(argv)
    except OSError as e:
        raise RuntimeFailure(f"could not start {argv[0]}: {e.strerror}", hint="is torch installed?") from None
    while True:
        try:
            return _exit_code(proc.wait())
        except KeyboardInterrupt:
            # torchrun got the SIGINT too and is shutting its workers down; give it time, then insist.
            try:
                return _exit_code(proc.wait(timeout=60))
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                proc.send_signal(signal.SIGKILL)
                return _exit_code(proc.wait())


def _exit_code(rc: int) -> int:
    # A child killed by signal N reports -N; shells report 128+N.
    return 128 - rc if rc < 0 else rc
