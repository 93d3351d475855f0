"""`llmctl plan --tp` through typer's CliRunner: the pin, bad degrees as one line with exit 2, tp in the JSON, the
table and the plan file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.spec.planfile import load_plan
from tests.plan.test_plan_cli import SEED as PINNED

runner = CliRunner()
# the seed's command of test_plan_cli.py without its --tp 1 pin: TP searched
SEED = [a for i, a in enumerate(PINNED) if "--tp" not in PINNED[max(0, i - 1) : i + 1]]


def invoke(args: list[str]):
    return runner.invoke(app, args, catch_exceptions=False)


def test_json_candidates_carry_tp_and_the_plan_file_records_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    r = invoke([*SEED, "--json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    for c in [data["chosen"], *data["candidates"]]:
        assert c["tp"] in (1, 2, 4) and isinstance(c["async_tp"], bool) and c["tp_comm_exposed_s"] >= 0
        assert c["micro_batch"] * c["grad_accum"] * c["gpus"] // (c["tp"] * c.get("pp", 1)) == 128
    assert {c["tp"] for c in data["candidates"]} >= {1, data["chosen"]["tp"]}
    assert data["tp_choice"]
    plan = load_plan(out)
    assert plan.parallel.tp == data["chosen"]["tp"] and plan.parallel.async_tp == data["chosen"]["async_tp"]
    assert plan.setup.dp * plan.setup.tp == plan.world_size


@pytest.mark.parametrize("tp", ["1", "2", "4"])
def test_tp_pin_is_honoured(tp: str, tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    r = invoke([*SEED, "--tp", tp, "--json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["chosen"]["tp"] == int(tp) and {c["tp"] for c in data["candidates"]} == {int(tp)}
    assert load_plan(out).parallel.tp == int(tp)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SEED, "--tp", "3"], "--tp 3 does not divide the 4 GPUs per node"),
        ([*SEED, "--tp", "8"], "--tp 8 does not divide the 4 GPUs per node"),
        ([*SEED, "--tp", "0"], "--tp must be a positive integer, got 0"),
        ([*SEED, "--tp", "2", "--loss-chunk", "512"], "tensor parallelism computes the loss on vocabulary shards"),
        (
            ["plan", "gpt2-xl", "--gpu", "A100-80GB", "--gpus", "4", "--tp", "4"],
            "--tp 4: gpt2 cannot use tensor parallelism",
        ),
        (
            ["plan", "smollm3-3b", "--gpu", "H100-SXM", "--gpus", "8", "--tp", "8"],
            "tp 8 does not divide smollm3's num_key_value_heads 4",
        ),
    ],
)
def test_bad_tp_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    r = invoke([*args, "-o", str(tmp_path / "p.yaml")])
    assert r.exit_code == 2, r.output
    assert message in r.output, r.output
    assert r.output.strip().count("\n") == 0, r.output
    assert not (tmp_path / "p.yaml").exists()


def test_table_shows_tp_and_explains_it(tmp_path: Path) -> None:
    r = invoke([*SEED, "--no-write"])
    assert r.exit_code == 0, r.output
    assert "tensor parallel" in r.output and "x TP " in r.output and "fewer tokens/s" in r.output
