"""`--finetune`, `--lora-rank`, `--lora-alpha` on estimate-memory and plan: the adapters' lines, the trainable
parameters, the plan file's finetune: section, the methods compared, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from llmctl.cli.main import app

runner = CliRunner()
EIGHT_B = ["llama-3.1-8b", "--gpu", "H100-SXM"]


def run(*args: str):
    return runner.invoke(app, list(args))


def one_line_error(r) -> str:
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("llmctl: error: "), r.output
    return lines[0]


def test_estimate_shows_the_adapters_and_the_trainable_parameters() -> None:
    r = run("estimate", *EIGHT_B, "--finetune", "lora")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.output.split())
    assert "trainable parameters 41,943,040 (0.52% of the model)" in flat
    for line in ("frozen base (bf16, sharded)", "gradients (fp32, adapters only)", "4 per adapter param"):
        assert line in flat
    d = json.loads(run("estimate-memory", *EIGHT_B, "--finetune", "lora", "--lora-rank", "64", "--json").stdout)
    assert d["finetune"]["trainable_params"] == 4 * 41_943_040 and d["finetune"]["lora_rank"] == 64
    ledger = {line["name"]: line for line in d["ledger"]}
    assert ledger["LoRA adapters (fp32, r64, sharded)"]["per_params"] == 4 * 41_943_040
    assert "per_params" not in ledger["frozen base (bf16, sharded)"]
    assert d["engine_bytes_per_param"] == pytest.approx(2 + 16 * 4 * 41_943_040 / d["params"])
    full = json.loads(run("estimate-memory", *EIGHT_B, "--json").stdout)
    assert "finetune" not in full and d["per_gpu_total_bytes"] < full["per_gpu_total_bytes"] / 2


def test_qlora_estimate() -> None:
    d = json.loads(run("estimate", *EIGHT_B, "--finetune", "qlora", "--json").stdout)
    names = [c["name"] for c in d["components"]]
    assert "frozen base (NF4 linears, bf16 rest, sharded)" in names
    assert "QLoRA: one linear's weight dequantized (compute dtype)" in names
    assert d["finetune"]["method"] == "qlora" and d["fits"]


def test_qlora_of_a_moe_says_its_experts_stay_in_the_compute_dtype() -> None:
    """Issue 49: Qwen3-30B-A3B's QLoRA base is ~1.95 bytes/param because its experts are stacked parameters (not
    nn.Linear), which the line now says; the adapters' savings are words, never negative GiB."""
    args = ("qwen3-30b-a3b", "--gpu", "H100", "--gpus", "8", "--finetune", "qlora")
    d = json.loads(run("estimate", *args, "--json").stdout)
    base = next(line for line in d["ledger"] if line["name"].startswith("frozen base"))
    assert base["name"] == "frozen base (NF4 linears 3.0% of params, bf16 rest: experts, sharded)"
    assert 1.9 < base["bytes_per_param"] < 2.0
    text = run("estimate", *args).stdout
    assert "with adapters it does not keep frozen linears' inputs" in text and " -0." not in text


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["estimate", *EIGHT_B, "--finetune", "partial"], "unknown fine-tuning method 'partial'"),
        (["estimate", *EIGHT_B, "--finetune", "lora", "--lora-rank", "0"], "--lora-rank must be a positive integer"),
        (["estimate", *EIGHT_B, "--finetune", "lora", "--lora-rank", "70000"], "out of range: at most 65,536"),
        (["estimate", *EIGHT_B, "--finetune", "lora", "--lora-alpha", "-1"], "--lora-alpha must be a positive"),
        (["estimate", *EIGHT_B, "--lora-rank", "8"], "--lora-rank and --lora-alpha apply to adapters"),
        (["estimate", *EIGHT_B, "--finetune", "lora", "--tp", "2", "--gpus", "2"], "tensor parallelism"),
        (["estimate", *EIGHT_B, "--finetune", "lora", "--offload"], "CPU offload"),
        (["estimate", *EIGHT_B, "--finetune", "qlora", "--precision", "fp32"], "QLoRA computes in bf16 or fp16"),
        (["plan", *EIGHT_B, "--gpus", "8", "--finetune", "lora", "--tp", "2", "--no-write"], "tensor parallelism"),
        (["plan", *EIGHT_B, "--gpus", "8", "--finetune", "lora", "--offload", "--no-write"], "CPU offload"),
        (["plan", *EIGHT_B, "--gpus", "8", "--lora-alpha", "8", "--no-write"], "apply to adapters"),
    ],
)
def test_one_line_errors(args: list[str], needle: str) -> None:
    assert needle in one_line_error(run(*args))


def test_plan_writes_the_finetune_section_and_compares_the_methods(tmp_path) -> None:
    out = tmp_path / "plan.yaml"
    args = ["plan", "llama-3.2-1b", "--gpu", "H100-SXM", "--gpus", "8", "--synthetic", "-o", str(out)]
    r = run(*args, "--finetune", "lora", "--lora-rank", "8", "--lora-alpha", "16")
    assert r.exit_code == 0, r.output
    section = yaml.safe_load(out.read_text())["finetune"]
    assert section == {"method": "lora", "lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "lora_targets": None}
    flat = " ".join(r.output.split())
    assert "fine-tuning: full: fits on " in flat and "lora r8: fits on 1 H100-SXM" in flat
    r = run(*args, "--force", "--json")
    assert r.exit_code == 0 and "finetune" not in yaml.safe_load(out.read_text())
    assert "finetune_choice" not in json.loads(r.stdout)
