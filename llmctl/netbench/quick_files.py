"""Where bench-net's quick mode (llmctl.netbench.quick, the torch half of the launch preflight) writes its results
in the folder its `--out` names; the preflight (llmctl.launch.preflight, above netbench) reads them from here.
Torch-free."""

from __future__ import annotations

from pathlib import Path


def node_result_path(out: Path, node: str) -> Path:
    """The node step's result: local rank 0 writes its node's check there, passed or failed."""
    return out / f"node-{node}.json"


def bench_path(out: Path) -> Path:
    """The cross step's bench-net report, written by rank 0."""
    return out / "bench.json"
