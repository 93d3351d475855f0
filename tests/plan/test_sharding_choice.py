"""FULL vs HYBRID answered in every multi-node plan (issue 48): the best setup of each strategy, which won and why
the other lost; on one node nothing (hybrid is full_shard there); and `--json` holds what the text says it holds of
the dropped setups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app

REPO = Path(__file__).resolve().parents[2]
SEED = str(REPO / "examples/clusters/plan-a100-2x4-50gbps.yaml")
IB = str(REPO / "examples/clusters/plan-h100-4x8-ib.yaml")
runner = CliRunner()

MULTI_NODE = {
    "seed 2 x 4 A100": ["llama-2-7b", "--cluster", SEED, "--seq-len", "1024"],
    "70B on 4 x 8 H100 IB": ["llama-3.1-70b", "--cluster", IB],
    "8B on 2 x 8 H100, slow network": ["llama-3.1-8b", "--gpu", "H100", "--nodes", "2", "--inter-gbps", "100"],
    "MoE on 2 nodes": ["qwen3-30b-a3b", "--gpu", "H100", "--nodes", "2", "--inter-gbps", "400", "--seq-len", "4096"],
    "full_shard pinned": ["llama-2-7b", "--cluster", SEED, "--seq-len", "1024", "--strategy", "full_shard"],
    "hybrid pinned": ["llama-2-7b", "--cluster", SEED, "--seq-len", "1024", "--strategy", "hybrid_shard"],
}


def plan_json(args: list[str]) -> dict:
    r = runner.invoke(app, ["plan", *args, "--json", "--no-write"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


@pytest.mark.parametrize("case", list(MULTI_NODE))
def test_every_multi_node_plan_answers_full_vs_hybrid(case: str) -> None:
    args = MULTI_NODE[case]
    d = plan_json(args)
    why = d["sharding_choice"]
    assert "FULL_SHARD" in why and "HYBRID_SHARD" in why, why
    r = runner.invoke(app, ["plan", *args, "--no-write"])
    assert r.exit_code == 0 and "FULL vs HYBRID:" in r.output


def test_the_loser_is_named_with_its_best_setup_and_why() -> None:
    d = plan_json(MULTI_NODE["8B on 2 x 8 H100, slow network"])
    why = d["sharding_choice"]
    winner = why.split(" wins", 1)[0]
    assert winner in ("FULL_SHARD", "HYBRID_SHARD")
    loser = "HYBRID_SHARD" if winner == "FULL_SHARD" else "FULL_SHARD"
    assert f"{loser}'s best, {loser} over" in why and ("fewer tokens/s" in why or "more cost" in why)


def test_a_pinned_strategy_says_the_other_was_not_searched() -> None:
    why = plan_json(MULTI_NODE["full_shard pinned"])["sharding_choice"]
    assert (
        why.startswith("FULL_SHARD's best: FULL_SHARD over")
        and "HYBRID_SHARD: not searched (--strategy full_shard)" in why
    )


def test_one_node_has_no_sharding_answer() -> None:
    d = plan_json(["llama-3.1-8b", "--gpu", "H100", "--gpus", "8"])
    assert "sharding_choice" not in d


def test_text_and_json_agree_on_the_dropped_setups() -> None:
    args = ["llama-3.1-70b", "--gpu", "H100", "--nodes", "32", "--inter-gbps", "400"]
    d = plan_json(args)
    total = d["rejected_count"]
    assert total > 50 and len(d["rejected"]) == 50
    r = runner.invoke(app, ["plan", *args, "--no-write"])
    assert r.exit_code == 0
    assert f"... and {total - 4} more (--json lists the first 50 of the {total})" in " ".join(r.output.split())


def test_a_short_dropped_list_is_all_in_the_json() -> None:
    args = ["llama-tiny", "--gpu", "H100", "--gpus", "8"]
    d = plan_json(args)
    assert d["rejected_count"] == len(d["rejected"]) <= 50
    r = runner.invoke(app, ["plan", *args, "--no-write"])
    if d["rejected_count"] > 4:
        assert f"... and {d['rejected_count'] - 4} more (see --json)" in r.output
