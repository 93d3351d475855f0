"""A new user's path on a laptop (issue 49): `llmctl plan MODEL --gpu cpu` writes a CPU plan (gloo, fp32, no compile,
SDPA), and the plan's relative paths resolve against its folder, so that it trains and checkpoints in the same
places whatever folder it is launched from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.spec import planpaths
from llmctl.spec.planfile import load_plan, plan_from_dict

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "examples" / "corpus" / "stdlib-docstrings.txt"


def invoke(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project folder, the current folder: a small text corpus and a folder for plans."""
    root = tmp_path / "proj"
    (root / "plans").mkdir(parents=True)
    (root / "corpus.txt").write_bytes(CORPUS.read_bytes()[:30_000])
    monkeypatch.chdir(root)
    monkeypatch.setenv("LLMCTL_JOBS_DIR", str(tmp_path / "jobs"))
    return root


def test_plan_gpu_cpu_writes_a_cpu_plan(project: Path) -> None:
    code, out, err = invoke("plan", "llama-tiny", "--gpu", "cpu", "--gpus", "2", "--seq-len", "128", "-o", "cpu.yaml")
    assert code == 0, out + err
    plan = load_plan("cpu.yaml")
    assert plan.hardware.gpu is None and (plan.hardware.nodes, plan.hardware.nproc_per_node) == (1, 2)
    t = plan.training
    assert (t.precision, t.compile, t.attention) == ("fp32", False, "sdpa")
    assert "fp32: cpu has no bf16 or fp16" in out
    # --nodes: a CPU plan over several machines (gloo between them)
    code, out, err = invoke(
        "plan", "llama-tiny", "--gpu", "cpu", "--nodes", "2", "--gpus-per-node", "1", "--inter-gbps", "10", "--no-write"
    )
    assert code == 0 and "on 2 x 1 cpu" in out, out + err
    # a flag still wins over the CPU's defaults
    code, out, err = invoke("plan", "llama-tiny", "--gpu", "cpu", "--gpus", "1", "--compile", "-o", "c.yaml")
    assert code == 0 and load_plan("c.yaml").training.compile is True, out + err


def test_estimate_memory_and_plan_files_know_the_cpu(project: Path) -> None:
    code, out, err = invoke("estimate-memory", "llama-tiny", "--gpu", "cpu", "--gpus", "2", "--seq-len", "128")
    assert code == 0 and "cpu" in out, out + err
    # a plan file may say `gpu: cpu`: read as null, the CPU (gloo), as every reader asks
    base = {"model": {"preset": "llama-tiny"}, "training": {"max_steps": 2, "precision": "fp32"}}
    assert plan_from_dict({**base, "hardware": {"gpu": "cpu"}}).hardware.gpu is None
    code, out, err = invoke("plan", "llama-tiny", "--gpu", "cpux", "--no-write")
    assert code == 2 and "did you mean: cpu?" in err, err


def test_paths_given_here_are_written_relative_to_the_plan(project: Path) -> None:
    """-o elsewhere: --data and --run-dir (typed relative to here) are written relative to the plan's folder; the
    default run folder (runs/<name>) stays as it is, beside the plan, and a note says where that is."""
    code, out, err = invoke(
        "plan", "llama-tiny", "--gpu", "cpu", "--gpus", "1", "--data", "corpus.txt", "--run-dir", "runs/mine",
        "-o", "plans/a.yaml",
    )  # fmt: skip
    assert code == 0, out + err
    raw = yaml.safe_load(Path("plans/a.yaml").read_text())
    assert raw["data"]["paths"] == ["../corpus.txt"]
    assert raw["checkpoint"]["dir"] == "../runs/mine/checkpoints" and raw["logging"]["dir"] == "../runs/mine"
    assert load_plan("plans/a.yaml").data.paths == [str(project / "corpus.txt")]
    code, out, err = invoke(
        "plan", "llama-tiny", "--gpu", "cpu", "--gpus", "1", "--data", "corpus.txt", "-o", "plans/b.yaml"
    )
    assert code == 0, out + err
    raw = yaml.safe_load(Path("plans/b.yaml").read_text())
    assert raw["logging"]["dir"] == "runs/llama-tiny-full_shard-1x1"
    assert "the run folder is plans/runs/llama-tiny-full_shard-1x1" in err
    # in the current folder: written as typed
    code, out, err = invoke(
        "plan", "llama-tiny", "--gpu", "cpu", "--gpus", "1", "--data", "./corpus.txt", "-o", "c.yaml"
    )
    assert code == 0 and yaml.safe_load(Path("c.yaml").read_text())["data"]["paths"] == ["./corpus.txt"]
    assert "resolve against its folder" not in err


def test_resolve_and_relocate(tmp_path: Path) -> None:
    data = {
        "model": {"config": "Qwen/Qwen3-8B", "weights": None},
        "data": {"paths": ["a", "/abs/b", "c/../d"], "val": "split", "tokenizer": "tok"},
        "checkpoint": {"dir": "runs/x/ck"},
        "logging": {"dir": "runs/x"},
    }
    out = planpaths.resolve(data, tmp_path)
    assert out["model"] == {"config": "Qwen/Qwen3-8B", "weights": None}  # a hub id stays an id
    assert out["data"]["paths"] == [str(tmp_path / "a"), "/abs/b", str(tmp_path / "d")]
    assert out["data"]["val"] == "split" and out["data"]["tokenizer"] == str(tmp_path / "tok")
    assert out["logging"]["dir"] == str(tmp_path / "runs/x")
    (tmp_path / "Qwen" / "Qwen3-8B").mkdir(parents=True)  # a folder of that name beside the plan is a path
    assert planpaths.resolve(data, tmp_path)["model"]["config"] == str(tmp_path / "Qwen/Qwen3-8B")
    here = tmp_path / "proj"
    assert planpaths.relocate({"data": {"paths": ["d", "/e"]}}, here / "p", cwd=here)["data"]["paths"] == ["../d", "/e"]
    assert planpaths.relocate({"data": {"paths": ["d"]}}, here, cwd=here)["data"]["paths"] == ["d"]
    # a plan written outside the project's tree gets absolute paths (a relative one would climb to the root)
    assert planpaths.relocate({"data": {"paths": ["d"]}}, tmp_path / "other", cwd=here)["data"]["paths"] == [
        str(here / "d")
    ]


@pytest.mark.dist
def test_a_cpu_plan_launched_from_another_folder_trains_and_checkpoints_beside_it(project: Path) -> None:
    """The user's steps: plan a CPU run of the tiny preset into plans/, then launch it from another folder; it reads
    the project's corpus and checkpoints in the plan's run folder (1 rank, 3 steps)."""
    code, out, err = invoke(
        "plan", "llama-tiny", "--gpu", "cpu", "--gpus", "1", "--seq-len", "32", "--global-batch", "2",
        "--tokens", "192", "--data", "corpus.txt", "-o", "plans/p.yaml",
    )  # fmt: skip
    assert code == 0, out + err
    elsewhere = project.parent / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)
    code, out, err = invoke("launch", "../proj/plans/p.yaml")
    assert code == 0, out + err
    run = project / "plans" / "runs" / "llama-tiny-full_shard-1x1"
    assert (run / "checkpoints" / "step_00000003").is_dir(), out + err
    assert (run / "metrics.jsonl").is_file()
    assert not (elsewhere / "runs").exists()
    # launched again from the project's folder: the same run (its checkpoint resumed, already at the last step)
    os.chdir(project)
    code, out, err = invoke("launch", "plans/p.yaml")
    assert code == 0 and "trained under another plan" not in out + err, out + err
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000003"]


def _prepared(project: Path) -> tuple[Path, int]:
    """`llmctl data prepare` of the corpus; its training sequences of 32 tokens (the engine's count, by hand)."""
    code, out, err = invoke("data", "prepare", "corpus.txt", "--out", "data/c")
    assert code == 0, out + err
    meta = json.loads((project / "data/c/meta.json").read_text())
    return project / "data/c", (meta["splits"]["train"]["tokens"] - 1) // 32


def test_epochs_sets_the_steps_from_the_prepared_set(project: Path) -> None:
    _, sequences = _prepared(project)
    flags = ["llama-tiny", "--gpu", "cpu", "--gpus", "1", "--seq-len", "32", "--global-batch", "4", "--data", "data/c"]
    code, out, err = invoke("plan", *flags, "--epochs", "2", "-o", "e.yaml")
    assert code == 0, out + err
    steps = -(-2 * sequences // 4)
    assert load_plan("e.yaml").total_steps == steps
    assert f"--epochs 2: {sequences:,} sequences a pass / 4 per step = {steps:,} steps" in out
    assert "pass over the training data" not in out + err  # 2 passes: no warning
    code, out, err = invoke("launch", "e.yaml", "--dry-run")
    assert code == 0 and "warning" not in err, err


def test_many_passes_warn_in_plan_and_launch_dry_run(project: Path) -> None:
    _, sequences = _prepared(project)
    flags = ["llama-tiny", "--gpu", "cpu", "--gpus", "1", "--seq-len", "32", "--global-batch", "4", "--data", "data/c"]
    code, out, err = invoke("plan", *flags, "-o", "many.yaml")  # the default 1,000 steps
    assert code == 0, out + err
    passes = 1000 * 4 / sequences
    line = f"1,000 steps pass over the training data {passes:,.1f} times"
    assert passes > 4 and f"warning: {line}" in out.replace("\n", " ")
    code, out, err = invoke("launch", "many.yaml", "--dry-run")
    assert code == 0, out + err
    assert [x for x in err.splitlines() if "warning" in x] == [
        f"warning: many.yaml: {line} (more than 4 repeats train little better than fewer: set the length with "
        "`llmctl plan --epochs N`, or --tokens)"
    ]


def test_epochs_refusals_come_first_in_one_line(project: Path) -> None:
    _prepared(project)
    base = ["plan", "llama-tiny", "--gpu", "cpu", "--gpus", "1", "-o", "x.yaml"]
    for extra, says in (
        (["--data", "data/c", "--epochs", "2", "--tokens", "1M"], "give either --epochs or --tokens"),
        (["--data", "corpus.txt", "--epochs", "2"], "--epochs: corpus.txt is not a prepared folder"),
        (["--epochs", "2"], "--epochs needs --data"),
        (["--data", "data/c", "--epochs", "0"], "--epochs must be a positive number"),
    ):
        code, out, err = invoke(*base, *extra)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, (extra, out, err)
        assert not Path("x.yaml").exists()
