"""`llmctl plan` writes a run, not only a prediction (issue 25): --data (checked now), --run-dir with checkpoints
on by default, --synthetic only when asked; one set of cluster flags (--gpus, --gpus-per-node from the catalog);
size suffixes; flags without effect refused; the memory margin stated and warned about."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.spec import hardware

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "corpus" / "stdlib-docstrings.txt"
runner = CliRunner()
TINY = ["plan", "llama-tiny", "--gpu", "A100-80GB", "--gpus", "1", "--seq-len", "128", "--global-batch", "16"]


def invoke(args: list[str]) -> tuple[int, str]:
    r = runner.invoke(app, args)
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder made by `llmctl data prepare` (bytes tokenizer) with a val split."""
    folder = tmp_path_factory.mktemp("data")
    docs = [d for d in CORPUS.read_text().split("\n\n") if d.strip()][:200]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    code, out = invoke(
        ["data", "prepare", str(folder / "docs.jsonl"), "--out", str(folder / "prep"), "--val-fraction", "0.1"]
    )
    assert code == 0, out
    return folder / "prep"


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_data_and_run_dir_make_a_runnable_plan(here: Path, prepared: Path) -> None:
    code, out = invoke([*TINY, "--data", str(prepared), "--run-dir", "myrun", "--checkpoint-every", "20", "--json"])
    assert code == 0, out
    data = json.loads(out)
    plan = yaml.safe_load((here / "plan.yaml").read_text())
    assert plan["data"] == {
        "kind": "tokens",
        "paths": [str(prepared)],
        "tokenizer": None,
        "jsonl_field": "text",
        "val": "split",
    }
    assert plan["checkpoint"]["dir"] == "myrun/checkpoints" and plan["logging"]["dir"] == "myrun"
    # Every 20 minutes at the planned step time, but never more than the run's own length.
    step_s = plan["predicted"]["step_time_s"]
    total = 1000  # no --tokens: max_steps 1000
    assert plan["training"]["max_steps"] == total
    assert plan["checkpoint"]["interval_steps"] == min(math.ceil(20 * 60 / step_s), total)
    assert any(n.startswith("data: ") and "val split" in n for n in data["run_notes"])


def test_checkpoint_interval_follows_the_step_time() -> None:
    from llmctl.plan.emit import checkpoint_interval_steps

    assert checkpoint_interval_steps(7.36, 30) == 245  # ceil(1800 / 7.36)
    assert checkpoint_interval_steps(3600.0, 30) == 1  # a step longer than the interval: every step
    assert checkpoint_interval_steps(0.5, 1) == 120


def test_default_run_dir_is_runs_plan_name(here: Path) -> None:
    code, out = invoke(
        ["plan", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--tp", "1", "--pp", "1", "--synthetic"]
    )
    assert code == 0, out
    plan = yaml.safe_load((here / "plan.yaml").read_text())
    # The preset's name whole (not cut at its first dot: "llama-3"), and the run folder under runs/.
    assert plan["name"] == "llama-3.1-8b-full_shard-1x8"
    assert plan["checkpoint"]["dir"] == "runs/llama-3.1-8b-full_shard-1x8/checkpoints"
    assert plan["data"]["kind"] == "synthetic" and "as asked" in out and "--allow-synthetic" in out


def test_no_data_warns_and_writes_synthetic(here: Path) -> None:
    code, out = invoke(TINY)
    assert code == 0, out
    assert "warning: no --data" in out and "launch` refuses it" in out
    assert yaml.safe_load((here / "plan.yaml").read_text())["data"]["kind"] == "synthetic"


def test_text_data_takes_the_model_folders_tokenizer_else_bytes(here: Path) -> None:
    code, out = invoke([*TINY, "--data", str(CORPUS)])
    assert code == 0, out
    d = yaml.safe_load((here / "plan.yaml").read_text())["data"]
    assert d["kind"] == "text" and d["paths"] == [str(CORPUS)] and d["tokenizer"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "nowhere"], "'nowhere' does not exist"),
        (["--data", "{prep}", "--synthetic"], "either --data PATH or --synthetic"),
        (["--tokenizer", "."], "--tokenizer only applies with --data"),
        (["--no-write", "--data", "{prep}"], "--data only apply to a plan file, and --no-write writes none"),
        (["--no-write", "--force"], "--force only apply to a plan file"),
        (["--no-write", "--run-dir", "x"], "--run-dir only apply"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be a positive number"),
        (["--data", "{prep}", "--data", "{corpus}"], "give it alone"),
        (["--run-dir", "{corpus}"], "is a file, not a folder"),
    ],
)
def test_run_flags_refused_in_one_line(here: Path, prepared: Path, args: list[str], message: str) -> None:
    args = [a.format(prep=prepared, corpus=CORPUS) for a in args]
    code, out = invoke([*TINY, *args])
    assert code == 2, out
    assert message in out and "Traceback" not in out
    assert not (here / "plan.yaml").exists()


def test_params_with_data_is_refused(here: Path) -> None:
    code, out = invoke(["plan", "--params", "7B", "--gpu", "H100", "--data", str(CORPUS)])
    assert code == 2 and "--params writes no plan file" in out


def test_prepared_vocabulary_larger_than_the_models_is_refused(here: Path, prepared: Path, tmp_path: Path) -> None:
    import shutil

    big = tmp_path / "big"
    shutil.copytree(prepared, big)
    meta = json.loads((big / "meta.json").read_text())
    meta["vocab_size"] = 50_000
    (big / "meta.json").write_text(json.dumps(meta))
    code, out = invoke([*TINY, "--data", str(big)])
    assert code == 2, out
    assert "50000 tokens but the model's vocabulary is" in out
    assert not (here / "plan.yaml").exists()


# --- one set of cluster flags ------------------------------------------------------------------------------------
def plan_json(args: list[str]) -> dict:
    code, out = invoke(["plan", *args, "--json", "--no-write"])
    assert code == 0, out
    return json.loads(out)


def test_gpus_fills_one_node_then_whole_nodes() -> None:
    assert hardware.resolve_gpu("H100").node_gpus == 8
    one = plan_json(["llama-tiny", "--gpu", "H100", "--gpus", "2"])
    assert (one["nodes"], one["gpus_per_node"]) == (1, 2)
    two = plan_json(["llama-tiny", "--gpu", "H100", "--gpus", "16", "--inter-gbps", "400"])
    assert (two["nodes"], two["gpus_per_node"]) == (2, 8)
    default = plan_json(["llama-tiny", "--gpu", "H100"])  # the kind's usual node, not one GPU
    assert (default["nodes"], default["gpus_per_node"]) == (1, 8)
    pinned = plan_json(["llama-tiny", "--gpu", "H100", "--gpus", "8", "--gpus-per-node", "4", "--inter-gbps", "400"])
    assert (pinned["nodes"], pinned["gpus_per_node"]) == (2, 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of 8 GPUs"),
        (["--gpus", "8", "--nodes", "1"], "either --gpus or --nodes"),
        (["--objective", "cost"], "--objective cost needs a price"),
        (["--seq-len", "12q"], "not a length in tokens"),
        (["--global-batch-tokens", "lots"], "is not a whole count"),
        (["--memory-margin", "1"], "--memory-margin must be a fraction"),
    ],
)
def test_cluster_and_size_flags_refused(args: list[str], message: str) -> None:
    code, out = invoke(["plan", "llama-tiny", "--gpu", "H100", "--no-write", *args])
    assert code == 2, out
    assert message in out


def test_cost_objective_with_a_price_keeps_the_cost() -> None:
    d = plan_json(["llama-tiny", "--gpu", "H100", "--objective", "cost", "--price", "2.5", "--tokens", "1B"])
    assert d["chosen"]["budget_cost_usd"] > 0


def test_size_suffixes() -> None:
    d = plan_json(["llama-tiny", "--gpu", "H100", "--gpus", "1", "--seq-len", "4k", "--global-batch-tokens", "1M"])
    assert d["seq_len"] == 4096  # binary thousands for a length
    assert d["global_batch_seqs"] == 1_000_000 // 4096  # decimal for a count, rounded down to whole sequences
    code, out = invoke(["estimate-memory", "llama-3.1-8b", "--seq-len", "128k", "--json"])
    assert code == 0, out
    assert json.loads(out)["setup"]["seq_len"] == 131072


def test_estimate_counts_gpus_in_the_kinds_nodes() -> None:
    """V100-32GB, 7B in fp32: the fewest GPUs are counted in nodes of 8 (the catalog's), not of 1."""
    code, out = invoke(["estimate-memory", "llama-2-7b", "--gpu", "v100", "--precision", "fp32", "--json"])
    assert code == 0, out
    d = json.loads(out)
    assert d["node_gpus"] == 8 and d["setup"]["gpus_per_node"] == 1  # the estimate itself is for one GPU
    full = d["min_gpus_by_strategy"]["full_shard"]
    assert full["gpus"] % 8 == 0 and full["nodes"] == full["gpus"] // 8
    code, out = invoke(["estimate-memory", "llama-2-7b", "--gpu", "h100", "--gpus", "16", "--json"])
    assert json.loads(out)["setup"]["nodes"] == 2 and json.loads(out)["setup"]["gpus_per_node"] == 8


def test_cluster_file_without_gpus_per_node_takes_the_kinds_node(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("gpu: H100\nnodes: 2\ninter_node_gbps: 400\n")
    d = plan_json(["llama-tiny", "--cluster", str(f)])
    assert (d["nodes"], d["gpus_per_node"]) == (2, 8)


# --- memory margin -----------------------------------------------------------------------------------------------
TIGHT = ["llama-3.1-8b", "--gpu", "H100", "--gpus", "16", "--inter-gbps", "3200", "--seq-len", "8k", "--tp", "1"]


def test_tight_memory_is_stated_and_warned() -> None:
    d = plan_json([*TIGHT, "--memory-margin", "0"])  # to the last byte: below the default margin, warned
    m = d["memory_margin"]
    assert m["predicted_bytes"] == d["chosen"]["memory_per_gpu_bytes"]
    assert m["free_bytes"] == m["gpu_bytes"] - m["predicted_bytes"]
    assert m["free_fraction"] < 0.06 and "under the default margin of 6%" in m["warning"]
    code, out = invoke(["plan", *TIGHT, "--memory-margin", "0", "--no-write"])
    assert "memory margin:" in out and "allocator headroom" in out and "warning: the chosen setup leaves" in out


def test_memory_margin_keeps_that_much_free() -> None:
    d = plan_json([*TIGHT, "--memory-margin", "0.05"])
    m = d["memory_margin"]
    assert m["predicted_bytes"] <= 0.95 * m["gpu_bytes"]
    assert (m["warning"] is not None) == (m["free_fraction"] < 0.06)  # asked below the default: warned when under it
    assert m["margin_fraction"] == 0.05
