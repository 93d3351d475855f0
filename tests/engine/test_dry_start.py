"""`llmctl launch PLAN --dry-start`: rank 0's setup of the plan's world in one local process (fake process group).

The 70B example plan (64 ranks) is checked on this CPU machine: rank 0's parameter, gradient and optimizer bytes
equal estimate-memory's fsdp2 ledger within 1%, and the process's peak resident memory stays under
(4 x params / 64) x 1.5 + 3 GiB. A small plan with --allocate-all shows that the sized gradients and AdamW states
are what the real optimizer allocates. Setup errors are one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.conftest import REPO, engine_env, write_plan
from tests.family_configs import tiny

EXAMPLE_70B = REPO / "examples" / "clusters" / "llama-3.1-70b-8x8-h100" / "plan.yaml"


def dry_start_json(plan: Path, cwd: Path, *flags: str) -> dict:
    out = cwd / "dry-start.json"
    proc = subprocess.run(
        [sys.executable, "-m", "llmctl.engine", "--dry-start", *flags, "--json-out", str(out), str(plan)],
        cwd=cwd,
        env=engine_env(cwd),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def llmctl(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmctl", *args],
        cwd=cwd,
        env=engine_env(cwd),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_the_70b_example_plan_starts_on_this_machine(tmp_path: Path) -> None:
    # The plan's data path is relative to its folder (../../../data/fineweb-edu: the repository's data/): the plan
    # copied to the same place under tmp_path, and a real (small) prepared folder there. With the test's own TMPDIR
    # (engine_env's, deep under tmp_path) the forkserver's socket path can pass 108 bytes.
    plan = tmp_path / EXAMPLE_70B.relative_to(REPO)
    plan.parent.mkdir(parents=True)
    plan.write_text(EXAMPLE_70B.read_text())
    prepare = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmctl",
            "data",
            "prepare",
            str(REPO / "examples" / "corpus"),
            "--out",
            "data/fineweb-edu",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert prepare.returncode == 0, prepare.stderr
    r = dry_start_json(plan, tmp_path)
    assert r["world_size"] == 64 and r["mesh"] == [64] and r["fsdp2"] is True
    assert r["params"] > 70e9
    by_line = {x["line"]: x for x in r["lines"]}
    assert set(by_line) == {"parameters", "gradients", "optimizer"}
    for line in by_line.values():
        assert line["ratio"] == pytest.approx(1.0, abs=0.01), line
    # Rank 0's fp32 master shard: 70.6e9 x 4 / 64 = 4.4 GB, really allocated (and initialized) here.
    assert by_line["parameters"]["allocated_bytes"] == by_line["parameters"]["bytes"]
    assert by_line["parameters"]["bytes"] == pytest.approx(4 * r["params"] / 64, rel=0.01)
    bound = (4 * r["params"] / 64) * 1.5 + 3 * 2**30
    assert r["rss_peak_bytes"] < bound, (r["rss_peak_bytes"] / 2**30, bound / 2**30)
    # Really allocated: the peak resident size rose by most of the shard (a lazy or meta allocation would add ~0).
    # Not all of it: on this VM's kernel the rise was 0.86-0.87 of the shard in three full-suite runs (1.0 alone),
    # pages of the shard written early in the init not counted by the end of it.
    assert r["rss_peak_bytes"] - r["rss_before_model_bytes"] >= 0.75 * by_line["parameters"]["bytes"]
    assert any("flash" in n for n in r["notes"])


@pytest.mark.parametrize("states", ["auto", "8bit"])
def test_allocate_all_measures_what_was_only_sized(tmp_path: Path, states: str) -> None:
    """The sized states equal the allocated ones and the estimate's; with 8-bit states (torchao's AdamW8bit) too:
    on the tiny model most shards are under torchao's 4096-value threshold and stay fp32, and the ledger knows it."""
    plan = write_plan(tmp_path, {"hardware": {"nproc_per_node": 4}, "optimizer": {"states": states}})
    r = dry_start_json(plan, tmp_path, "--allocate-all")
    assert r["allocate_all"] is True and r["world_size"] == 4
    for line in r["lines"]:
        assert line["allocated_bytes"] == line["bytes"], line
        assert line["ratio"] == pytest.approx(1.0, abs=0.01), line


@pytest.mark.parametrize(("precision", "ranks"), [("fp32", 4), ("bf16-mixed", 4), ("bf16-mixed", 1)])
def test_lora_holds_what_estimate_memory_says(tmp_path: Path, precision: str, ranks: int) -> None:
    """LoRA on 4 ranks (and on one, without FSDP2): the frozen base in the compute dtype plus fp32 adapters, gradients
    and AdamW states of the adapters only, allocated, equal the adapter ledger of estimate-memory exactly (the issue
    asks within 3%). A mutant that keeps gradients or states for the base, or the base in fp32 under bf16-mixed, is
    off by far more."""
    plan = write_plan(
        tmp_path,
        {
            "hardware": {"nproc_per_node": ranks},
            "training": {"precision": precision},
            "finetune": {"method": "lora", "lora_rank": 8},
        },
    )
    r = dry_start_json(plan, tmp_path, "--allocate-all")
    by_line = {line["line"]: line for line in r["lines"]}
    for line in r["lines"]:
        assert line["allocated_bytes"] == line["bytes"], line
        assert line["ratio"] == pytest.approx(1.0, abs=0.005), line
    # the adapters only (12% of this tiny model at rank 8; full training's gradients are the parameters' size)
    assert by_line["gradients"]["bytes"] < 0.25 * by_line["parameters"]["bytes"]
    assert "LoRA adapters new" in r["init"]


def test_the_cli_prints_the_table_and_the_verdict(tmp_path: Path) -> None:
    plan = write_plan(
        tmp_path, {"hardware": {"nodes": 2, "nproc_per_node": 2}, "parallel": {"sharding": "hybrid_shard"}}
    )
    proc = llmctl(["launch", str(plan), "--dry-start"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "rank 0 of 4" in out and "mesh 2 replicate x 2 shard" in out
    assert "parameters" in out and "optimizer (sized)" in out and "estimate-memory" in out
    assert "peak resident memory" in out and out.strip().endswith("launch it without --dry-start")
    assert not list(tmp_path.glob("llmctl-jobs*")), "a dry start must not create a job folder"


def test_dry_start_at_another_tp_sizes_each_rank_exactly(tmp_path: Path) -> None:
    """--tp: the plan's world split 2 x tp 2; every state line equals the estimate's (norms replicated, the rest
    split by tp, then sharded by dp); the plan file is not rewritten; a tp that cannot split the world is one line."""
    plan = write_plan(tmp_path, {"hardware": {"nproc_per_node": 4}})
    before = plan.read_text()
    proc = llmctl(["launch", str(plan), "--dry-start", "--tp", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "mesh 2 shard x 2 tp" in proc.stdout, proc.stdout
    ratios = [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.strip().startswith(("parameters", "grad", "opt"))]
    assert len(ratios) == 3 and all(r == "1.000" for r in ratios), proc.stdout
    assert plan.read_text() == before
    proc = llmctl(["launch", str(plan), "--dry-start", "--tp", "3"], tmp_path)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "tp=3" in errors[0], proc.stderr


def test_dry_start_at_another_cp_shards_over_data_x_cp(tmp_path: Path) -> None:
    """--cp: the world split 2 shard x 2 cp; FSDP shards every state over the 4 ranks of shard x cp, as the
    estimate says; a cp whose chunks do not divide the sequence, or a model ring attention cannot run, is one line."""
    plan = write_plan(tmp_path, {"hardware": {"nproc_per_node": 4}})
    proc = llmctl(["launch", str(plan), "--dry-start", "--cp", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "mesh 2 shard x 2 cp" in proc.stdout and "at cp 2" in proc.stderr, proc.stdout + proc.stderr
    ratios = [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.strip().startswith(("parameters", "grad", "opt"))]
    assert len(ratios) == 3 and all(r == "1.000" for r in ratios), proc.stdout
    proc = llmctl(["launch", str(plan), "--dry-start", "--cp", "2", "--tp", "2"], tmp_path)
    assert proc.returncode == 0 and "mesh 1 shard x 2 cp x 2 tp" in proc.stdout, proc.stdout + proc.stderr
    proc = llmctl(["launch", str(plan), "--dry-start", "--cp", "4"], tmp_path)  # 64 tokens in 8 chunks: fine
    assert proc.returncode == 0, proc.stderr
    bad = write_plan(tmp_path / "odd", {"hardware": {"nproc_per_node": 4}, "training": {"seq_len": 60}})
    proc = llmctl(["launch", str(bad), "--dry-start", "--cp", "4"], tmp_path)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "seq len 60 is not divisible by 8" in errors[0], proc.stderr
    (tmp_path / "gemma2.json").write_text(json.dumps(tiny("gemma2")))
    gemma = write_plan(tmp_path / "gemma", {"hardware": {"nproc_per_node": 4}, "training": {"attention": "sdpa"}})
    gemma.write_text(gemma.read_text().replace("preset: llama-tiny", f"config: {tmp_path / 'gemma2.json'}"))
    proc = llmctl(["launch", str(gemma), "--dry-start", "--cp", "2"], tmp_path)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "soft-capped" in errors[0], proc.stderr


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"data": {"kind": "tokens", "paths": ["nowhere/fineweb-edu"]}}, "nowhere/fineweb-edu"),
        ({"model": {"preset": None, "overrides": {}, "weights": "no-such-folder"}}, "no-such-folder"),
    ],
    ids=["missing-data", "missing-weights"],
)
def test_setup_errors_are_one_line_exit_2(tmp_path: Path, over: dict, needle: str) -> None:
    plan = write_plan(tmp_path, over)
    proc = llmctl(["launch", str(plan), "--dry-start"], tmp_path)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert proc.returncode == 2, proc.stderr
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in proc.stderr, proc.stderr


def test_a_weight_shape_that_disagrees_with_the_config_is_named(tmp_path: Path) -> None:
    from tests.engine.test_materialize import save_tiny_llama

    hf = tmp_path / "hf"
    save_tiny_llama(hf)
    plan = write_plan(
        tmp_path,
        {
            "model": {"preset": None, "weights": str(hf), "overrides": {"hidden_size": 128}},
            "hardware": {"nproc_per_node": 8},
        },
    )
    proc = llmctl(["launch", str(plan), "--dry-start"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert len(err) == 1 and "model.embed_tokens.weight" in err[0] and "[300, 64]" in err[0], proc.stderr


def test_flags_that_need_dry_start(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    proc = llmctl(["launch", str(plan), "--allocate-all"], tmp_path)
    assert proc.returncode == 2 and "--allocate-all only applies with --dry-start" in proc.stderr
    proc = llmctl(["launch", str(plan), "--tp", "2"], tmp_path)
    assert proc.returncode == 2 and "--tp only applies with --dry-start" in proc.stderr
    proc = llmctl(["launch", str(plan), "--cp", "2"], tmp_path)
    assert proc.returncode == 2 and "--cp only applies with --dry-start" in proc.stderr
    proc = llmctl(["launch", str(plan), "--dry-start", "--dry-run"], tmp_path)
    assert proc.returncode == 2 and "give one" in proc.stderr
    assert set(os.listdir(tmp_path)) <= {"plan.yaml", "scratch"}, "a refused launch must not create anything"


@pytest.mark.slow
def test_the_seed_v100_case_plans_fp16_and_starts(tmp_path: Path) -> None:
    """The seed's case (GPT-2 XL, FSDP over 4 x V100-16GB, mixed precision): plan picks fp16-mixed (V100 has no
    bf16) and says why; rank 0's dry start builds it (FSDP2 with an fp16 MixedPrecisionPolicy over fp32 masters) and
    its state bytes match estimate-memory's."""
    plan = tmp_path / "plan.yaml"
    args = ["plan", "gpt2-xl", "--gpu", "V100-16GB", "--nodes", "1", "--gpus-per-node", "4", "--synthetic"]
    proc = llmctl([*args, "-o", str(plan)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "precision: fp16-mixed: V100-16GB has no bf16 tensor cores" in " ".join(proc.stdout.split())
    assert "precision: fp16-mixed" in plan.read_text()
    proc = llmctl(["launch", str(plan), "--dry-start"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ratios = [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.strip().startswith(("parameters", "grad", "opt"))]
    assert len(ratios) == 3 and all(r == "1.000" for r in ratios), proc.stdout


def test_qlora_holds_what_estimate_memory_says(tmp_path: Path) -> None:
    """QLoRA on 4 ranks: each block linear in NF4 (torchao's packed tensors, this tiny model's shapes at scale blocks
    of 1 to 16 absmaxes), the rest in bf16, fp32 adapters with their gradients and AdamW states: what the engine
    holds equals the ledger within 0.5% (the issue asks 3%). A base left in bf16 holds ~3x the NF4 bytes; one
    quantized per shard, or sized at the paper's 256-absmax scale blocks, is off by more than the bound."""
    over = {"hardware": {"nproc_per_node": 4}, "training": {"precision": "bf16-mixed"}}
    plan = write_plan(tmp_path / "q", {**over, "finetune": {"method": "qlora", "lora_rank": 8}})
    r = dry_start_json(plan, tmp_path / "q", "--allocate-all")
    for line in r["lines"]:
        assert line["allocated_bytes"] == line["bytes"], line
        assert line["ratio"] == pytest.approx(1.0, abs=0.005), line
    assert "linears" in r["init"] and "in NF4" in r["init"]
    bf16 = write_plan(tmp_path / "l", {**over, "finetune": {"method": "lora", "lora_rank": 8}})
    lora_params = next(x for x in dry_start_json(bf16, tmp_path / "l")["lines"] if x["line"] == "parameters")
    qlora_params = next(x for x in r["lines"] if x["line"] == "parameters")
    assert qlora_params["bytes"] < 0.8 * lora_params["bytes"]  # the embeddings and LM head stay bf16 in both


def test_dry_start_under_pp_holds_rank_0s_stages(tmp_path: Path) -> None:
    """pp 2 interleaved over 2 layers (4 stages: the embedding alone, a block each, the norm and head alone): rank 0
    runs stages 0 and 2, so it holds the embedding and the second block, sharded over FSDP 2; nothing else."""
    plan = write_plan(
        tmp_path,
        {
            "hardware": {"nproc_per_node": 4},
            "parallel": {"pp": 2, "pp_schedule": "interleaved-1f1b"},
            "training": {"micro_batch_size": 2, "grad_accum_steps": 2},
        },
    )
    got = dry_start_json(plan, tmp_path)
    assert got["mesh_dims"] == ["pp", "shard"] and got["mesh"] == [2, 2] and got["fsdp2"] is True
    held = {r["line"]: r["bytes"] for r in got["lines"]}
    embedding = 320 * 64  # the padded vocabulary x hidden
    assert held["parameters"] == 4 * (embedding + got["layer_params"]) // 2
    assert held["gradients"] == held["parameters"]
    assert any("holds stages [0, 2] of 4" in n for n in got["notes"]), got["notes"]


def test_dry_start_at_ep_holds_rank_0s_experts(tmp_path: Path) -> None:
    """--ep 2 on 4 ranks of the tiny MoE (8 experts on every layer): rank 0 holds 4 of each layer's experts, sharded
    over the other 2 ranks of its efsdp group, and every state line equals the estimate's; a dense model is one line."""
    plan = write_plan(tmp_path, {"hardware": {"nproc_per_node": 4}})
    doc = plan.read_text().replace("preset: llama-tiny", "preset: moe-tiny")
    plan.write_text(doc)
    proc = llmctl(["launch", str(plan), "--dry-start", "--ep", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "ep 2: rank 0 holds 4 of every MoE layer's 8 routed experts, FSDP-sharded over 2 ranks" in out, out
    ratios = [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.strip().startswith(("parameters", "grad", "opt"))]
    assert len(ratios) == 3 and all(r == "1.000" for r in ratios), proc.stdout
    plan.write_text(doc.replace("preset: moe-tiny", "preset: llama-tiny"))
    proc = llmctl(["launch", str(plan), "--dry-start", "--ep", "2"], tmp_path)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "is dense" in errors[0], proc.stderr
