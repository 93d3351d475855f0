"""Precisions through the CLI: `--precision auto` on GPUs without bf16 (V100, T4) and the line that says why, float8
refused in one line on a GPU without float8 tensor cores, the plan file's canonical precision name, and what
estimate-memory shows under float8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.spec.planfile import load_plan

runner = CliRunner()


def test_the_v100_seed_plans_fp16_mixed_and_says_why(tmp_path: Path) -> None:
    """The issue's seed: gpt2-xl on one node of 4 V100-16GB, nothing else asked. V100 has no bf16, so auto is
    fp16-mixed (loss-scaled), at GPT-2's 1024 learned positions; the plan file carries the policy's name."""
    out = tmp_path / "plan.yaml"
    r = runner.invoke(
        app, ["plan", "gpt2-xl", "--gpu", "V100-16GB", "--nodes", "1", "--gpus-per-node", "4", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "4 V100-16GB; seq 1024" in text and "fp16-mixed" in text.split("\n")[0]
    assert (
        "precision: fp16-mixed: V100-16GB has no bf16 tensor cores; fp16 with dynamic loss scaling runs at 125 " in text
    )
    plan = load_plan(out)
    assert plan.training.precision == "fp16-mixed" and plan.training.seq_len == 1024
    assert plan.setup.precision.loss_scaling


def test_auto_on_a_t4_is_fp16_mixed_in_json() -> None:
    r = runner.invoke(app, ["plan", "gpt2-xl", "--gpu", "T4", "--gpus", "4", "--no-write", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["precision"] == "fp16-mixed" and out["precision_choice"].startswith("fp16-mixed: T4 has no bf16")


@pytest.mark.parametrize("command", ["plan", "estimate-memory"])
@pytest.mark.parametrize("gpu", ["A100-80GB", "V100-32GB"])
def test_float8_on_a_gpu_without_float8_tensor_cores_is_one_line(command: str, gpu: str) -> None:
    extra = ["--no-write"] if command == "plan" else []
    r = runner.invoke(app, [command, "llama-3.1-8b", "--gpu", gpu, "--gpus", "8", "--precision", "fp8", *extra])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert f"{gpu} has no float8 tensor cores" in lines[0] and "--precision bf16-mixed" in lines[0]
    assert "Traceback" not in r.output


def test_an_fp8_plan_file_says_fp8_tensorwise_and_the_explanation_prices_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    r = runner.invoke(
        app, ["plan", "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--precision", "float8", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert load_plan(out).training.precision == "fp8-tensorwise"
    text = " ".join(r.stdout.split())
    assert (
        "precision: fp8-tensorwise: 86.8% of the model FLOPs (the linears torchao converts) at the fp8 peak, 1979"
        in text
    )
    assert "MFU is against the bf16 peak" in text


def test_estimate_shows_the_float8_lines() -> None:
    r = runner.invoke(
        app,
        ["estimate", "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--precision", "fp8", "--micro-batch", "2"],
    )
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    for line in (
        "unsharded layers (FSDP float8 all-gather)",
        "float8 copies of one linear (forward)",
        "float8 copies of one linear (backward)",
        "float8 (tensorwise): torchao converts 224 linears, 86.8% of the model FLOPs, and FSDP all-gathers their "
        "weights in float8; kept in bf16: lm_head.",
    ):
        assert line in text, line
    r = runner.invoke(app, ["estimate", "llama-3.1-8b", "--gpus", "8", "--precision", "fp8", "--json"])
    assert r.exit_code == 0, r.output  # without a GPU nothing is checked; the float8 lines are still there
    assert json.loads(r.stdout)["float8"]["recipe"] == "tensorwise"
