"""`--cp` on `llmctl estimate-memory` and `llmctl plan` through typer's CliRunner: the ring's memory lines and fields,
cp in the JSON, the table and the plan file, and bad degrees as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.spec.planfile import load_plan

runner = CliRunner()
PLAN_128K = ["plan", "llama-3.1-8b", "--gpu", "H100", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "128k"]
EST_128K = ["estimate-memory", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--seq-len", "128k"]


def invoke(args: list[str]):
    return runner.invoke(app, args, catch_exceptions=False)


def test_estimate_shows_the_ring_lines_and_fields() -> None:
    r = invoke([*EST_128K, "--cp", "4", "--checkpointing", "full", "--loss-chunk", "512", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["setup"]["cp"] == 4
    cp = data["context_parallel"]
    assert cp["tokens_per_rank"] == 32768 and cp["fsdp_shard"] == 8
    # One rank's k and v: 32,768 tokens x 8 kv heads x 128 x bf16, twice; all 4 ranks' gathered in the forward.
    kv = 2 * 32768 * 8 * 128 * 2
    assert cp["ring_forward_kv_bytes"] == 4 * kv
    names = {c["name"] for c in data["components"]}
    assert {
        "ring attention K/V in flight (forward)",
        "ring attention fp32 merge (forward)",
        "ring attention K/V in flight (backward)",
        "ring attention fp32 gradients + dK/dV rotation (backward)",
    } <= names
    assert cp["activations_at_cp1_bytes"] > 3 * cp["activations_bytes"]
    table = invoke([*EST_128K, "--cp", "4", "--checkpointing", "full", "--loss-chunk", "512"])
    assert table.exit_code == 0, table.output
    assert (
        "ring attention fp32 merge (forward)" in table.output and "context parallel: cp 4 holds 32,768" in table.output
    )
    assert ", cp=4 (shard degree 8)" in table.output


def test_plan_json_carries_cp_and_the_plan_file_records_it(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    r = invoke([*PLAN_128K, "--json", "-o", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["chosen"]["cp"] > 1 and data["chosen"]["cp_rotate"] in ("allgather", "alltoall")
    for c in [data["chosen"], *data["candidates"]]:
        dp = c["gpus"] // (c["tp"] * c["cp"] * c.get("pp", 1))
        assert c["micro_batch"] * c["grad_accum"] * dp == data["global_batch_seqs"]
    assert data["cp_choice"].startswith(f"CP {data['chosen']['cp']}: at 131,072 tokens")
    plan = load_plan(out)
    assert plan.parallel.cp == data["chosen"]["cp"] and plan.training.loss_chunk_tokens > 0


def test_plan_table_shows_cp_and_explains_it() -> None:
    r = invoke([*PLAN_128K, "--no-write"])
    assert r.exit_code == 0, r.output
    assert "context parallel" in r.output and " x CP " in r.output and "ring" in r.output


def test_plan_cp_pin_is_honoured(tmp_path: Path) -> None:
    r = invoke([*PLAN_128K, "--cp", "4", "--json", "--no-write"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert {c["cp"] for c in [data["chosen"], *data["candidates"]]} == {4}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*PLAN_128K, "--cp", "3"], "--cp 3 does not divide the 8 GPUs"),
        ([*PLAN_128K, "--cp", "0"], "--cp must be a positive integer, got 0"),
        ([*PLAN_128K, "--cp", "2", "--attention", "flash"], "context parallelism runs ring attention on SDPA"),
        (
            ["plan", "gemma-2-9b", "--gpu", "H100", "--gpus", "8", "--cp", "2"],
            "--cp 2: gemma2 cannot use context parallelism",
        ),
        ([*EST_128K, "--cp", "3"], "cannot be split into tp=1 x cp=3"),
        ([*EST_128K, "--cp", "0"], "--cp must be a positive integer, got 0"),
        ([*EST_128K, "--cp", "2", "--attention", "flash"], "context parallelism runs ring attention on SDPA"),
        (
            ["estimate-memory", "gpt-oss-20b", "--gpu", "H100", "--gpus", "8", "--cp", "2"],
            "--cp 2: gpt_oss cannot use context parallelism",
        ),
        ([*EST_128K, "--cp", "8", "--seq-len", "1000"], "seq len 1000 is not divisible by 16"),
    ],
)
def test_bad_cp_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    extra = ["-o", str(tmp_path / "p.yaml")] if args[0] == "plan" else []
    r = invoke([*args, *extra])
    assert r.exit_code == 2, r.output
    assert message in r.output, r.output
    assert r.output.strip().count("\n") == 0, r.output
    assert not (tmp_path / "p.yaml").exists()
