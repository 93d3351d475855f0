"""`--offload` on estimate-memory and plan: the host's lines and its memory per node, the planner's pin, and one-line
errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.units import GIB

runner = CliRunner()
SEVENTY_B = ["llama-3.1-70b", "--gpu", "A100-80GB", "--gpus", "8"]


def run(*args: str):
    return runner.invoke(app, list(args))


def one_line_error(r) -> str:
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code != 0 and len(lines) == 1 and lines[0].startswith("llmctl: error: "), r.output
    return lines[0]


def test_estimate_json_has_the_host_lines_only_under_offload() -> None:
    r = run("estimate-memory", *SEVENTY_B, "--offload", "--checkpointing", "full", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    off = d["offload"]
    assert [c["name"] for c in off["host_components"]] == [
        "parameters (fp32 master, sharded)",
        "bf16 weights",
        "gradients (fp32)",
        "optimizer states (adamw)",
    ]
    assert off["host_bytes_per_node"] == 8 * off["host_bytes_per_gpu"] == 16 * d["params"]
    assert off["host_capacity_bytes_per_node"] == 1024 * GIB and off["host_fits"] is False
    assert d["fits"] is False and d["max_micro_batch"] == 0 and d["per_gpu_total_bytes"] < 19 * GIB
    assert "optimizer states (adamw)" not in d["per_gpu_bytes"]
    plain = json.loads(run("estimate-memory", *SEVENTY_B, "--checkpointing", "full", "--json").stdout)
    assert "offload" not in plain and "optimizer states (adamw)" in plain["per_gpu_bytes"]


def test_estimate_table_says_the_host_does_not_fit() -> None:
    r = run("estimate-memory", *SEVENTY_B, "--offload", "--checkpointing", "full")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "kept by fsdp2, in host memory (CPU offload)" in flat
    assert "CPU offload: the host holds 1,051.3 GiB per node of 8 GPUs (131.4 per GPU" in flat
    assert "does NOT fit in 1,024 GiB (A100-80GB's node in the GPU catalog: 128 per GPU)" in flat
    assert "does NOT fit (host memory) at micro-batch 1" in flat
    ok = run("estimate-memory", *SEVENTY_B, "--offload", "--checkpointing", "full", "--optimizer-states", "bf16")
    assert "788.5 GiB per node" in " ".join(ok.output.split()) and "fits at micro-batch 1" in ok.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["estimate-memory", "llama-3.1-8b", "--offload", "--engine", "zero"],
            "CPU offload is FSDP2's CPUOffloadPolicy: not run with engine zero",
        ),
        (["plan", *SEVENTY_B, "--no-write"], "with CPU offload: llama-3.1-70b does not fit"),
        (["plan", *SEVENTY_B, "--no-write", "--no-offload"], "the smallest cluster of A100-80GB that fits is 2 nodes"),
    ],
)
def test_one_line_errors(args: list[str], needle: str) -> None:
    assert needle in one_line_error(run(*args))


def test_plan_pinned_and_chosen() -> None:
    r = run("plan", "llama-3.2-1b", "--gpu", "H100-SXM", "--gpus", "8", "--offload", "--no-write", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["chosen"]["offload"] is True and d["chosen"]["offload_s"] > 0
    assert d["offload_choice"].startswith("on as pinned (--offload)")
    r = run("plan", *SEVENTY_B, "--optimizer-states", "bf16", "--no-write")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "CPU offload: on: no setup fits the GPUs without it" in flat and "+ CPU offload" in flat
    plain = json.loads(run("plan", "llama-3.2-1b", "--gpu", "H100-SXM", "--gpus", "8", "--no-write", "--json").stdout)
    assert "offload" not in plain["chosen"] and "offload_choice" not in plain
