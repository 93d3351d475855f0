"""The real-setup example plans validate with the plan schema and render into valid sbatch scripts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from launch_helpers import REPO
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import InputError
from llmctl.launch import shell
from llmctl.spec.planfile import load_plan

EXAMPLES = {
    "llama-2-7b-2x4-a100": (2, 4, "A100-80GB"),
    "llama-3.1-8b-1x8-h100": (1, 8, "H100-SXM"),
    "llama-3.1-70b-8x8-h100": (8, 8, "H100-SXM"),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_plan_validates_and_renders(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = REPO / "examples" / "clusters" / name
    plan = load_plan(folder / "plan.yaml")
    assert (plan.hardware.nodes, plan.hardware.nproc_per_node, plan.hardware.gpu) == EXAMPLES[name]
    assert plan.checkpoint.dir and plan.predicted.tokens_per_s
    assert (folder / "README.md").is_file()
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["launch", str(folder / "plan.yaml"), "--slurm", "-p", "gpu", "-t", "2-0", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert f"#SBATCH --nodes={plan.hardware.nodes}" in result.output
    assert f"#SBATCH --gpus-per-node={plan.hardware.nproc_per_node}" in result.output
    subprocess.run(["bash", "-n"], input=result.output, text=True, check=True)


@given(st.lists(st.text(), max_size=4))
def test_join_round_trips_any_argv(argv: list[str]) -> None:
    import shlex

    argv = [a.replace("\0", "") for a in argv]
    assert shlex.split(shell.join(argv)) == argv


@given(st.text(min_size=1))
def test_directive_values_are_one_plain_line(value: str) -> None:
    for option in ("partition", "account", "qos", "constraint", "exclude", "time"):
        try:
            ok = shell.check_directive(option, value)
        except InputError:
            continue
        assert ok.isprintable() and not any(c in ok for c in " \t\n\r'\"$`;\\")


def test_the_finetune_example_reads_the_tiny_runs_export() -> None:
    """examples/finetune-cpu.yaml continues from `llmctl export` of examples/tiny-cpu.yaml's run (README)."""
    tiny = load_plan(REPO / "examples" / "tiny-cpu.yaml")
    ft = load_plan(REPO / "examples" / "finetune-cpu.yaml")
    assert ft.model.weights == f"{Path(tiny.checkpoint.dir or '').parent}/hf"
    assert ft.world_size == tiny.world_size and ft.training.seq_len == tiny.training.seq_len
    assert ft.optimizer.lr < tiny.optimizer.lr


def test_the_lora_example_adapts_the_same_base() -> None:
    """examples/lora-cpu.yaml trains rank-8 adapters on the base examples/finetune-cpu.yaml fine-tunes whole (README:
    "LoRA: train adapters on a frozen base"), with LoRA's own checkpoint folder."""
    ft = load_plan(REPO / "examples" / "finetune-cpu.yaml")
    lo = load_plan(REPO / "examples" / "lora-cpu.yaml")
    assert lo.model.weights == ft.model.weights and lo.setup.finetune.adapters and not ft.setup.finetune.adapters
    assert (lo.finetune.lora_rank, lo.finetune.lora_alpha) == (8, 16)
    assert lo.checkpoint.dir != ft.checkpoint.dir


def test_the_qlora_example_is_the_lora_example_on_a_4bit_base() -> None:
    """examples/qlora-cpu.yaml: the LoRA example's adapters, data and schedule on the same base, quantized to NF4,
    in bf16 (QLoRA refuses an fp32 compute dtype), with its own checkpoint and log folders."""
    lo = load_plan(REPO / "examples" / "lora-cpu.yaml")
    q = load_plan(REPO / "examples" / "qlora-cpu.yaml")
    assert q.setup.finetune.method == "qlora" and q.model.weights == lo.model.weights
    assert (q.finetune.lora_rank, q.finetune.lora_alpha, q.training.max_steps) == (8, 16, lo.training.max_steps)
    assert q.setup.precision.compute_dtype == "bf16"
    assert q.checkpoint.dir != lo.checkpoint.dir and q.logging.dir != lo.logging.dir


def test_the_moe_example_splits_its_experts_over_its_ranks() -> None:
    """examples/moe-cpu.yaml (README: training MoE models): a Qwen3-MoE with 8 experts top-2 on every layer, ep 2 over
    its 2 ranks (4 experts each, no FSDP of the experts left), every model and engine rule passing."""
    from llmctl.engine.model import model_spec_for
    from llmctl.spec.rules import engine_problem, model_problem

    plan = load_plan(REPO / "examples" / "moe-cpu.yaml")
    spec = model_spec_for(plan.model)
    assert plan.setup.ep == 2 and plan.world_size == 2 and plan.setup.dims.expert_shard == 1
    assert all(la.mlp.num_experts == 8 and la.mlp.experts_per_token == 2 for la in spec.layers)
    assert model_problem(plan.setup, spec) is None and engine_problem(plan.setup) is None
