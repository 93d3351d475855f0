"""The engine's command line: a bad plan or bad input is one clear line on stderr and exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.conftest import REPO, engine_env, write_plan


def engine(args: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmctl.engine", *args],
        cwd=REPO,
        env=engine_env(tmp),
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("llmctl: error: ") and "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (
            "model: {preset: llama-tiny}\ntraining: {max_steps: 2, micro_batch: 4}\n",
            ("training.micro_batch", "unknown key"),
        ),
        ("model: {preset: llama-tiny}\ntraining: {max_steps: 0}\n", ("training.max_steps",)),
        ("model: {preset: llama-tiny, config: x.json}\ntraining: {max_steps: 1}\n", ("exactly one of model.preset",)),
        ("model: [oops\n", ("not valid YAML",)),
        ("- just a list\n", ("a plan must be a YAML mapping",)),
    ],
)
def test_bad_plan_file(tmp_path: Path, text: str, needles: tuple[str, ...]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert_one_line(engine([str(bad)], tmp_path), 2, str(bad), *needles)


def test_missing_plan_and_no_arguments(tmp_path: Path) -> None:
    assert_one_line(engine([str(tmp_path / "nope.yaml")], tmp_path), 2, "no such plan file")
    assert_one_line(engine([], tmp_path), 2, "expected one plan file")


def test_inputs_found_bad_after_torch_starts(tmp_path: Path) -> None:
    """Errors found once torch is up (attention on this machine, rank count, data) are one line too."""
    flash = write_plan(
        tmp_path / "flash",
        {"hardware": {"nproc_per_node": 1}, "training": {"attention": "flash", "precision": "bf16-mixed"}},
    )
    assert_one_line(engine([str(flash)], tmp_path), 2, "attention: flash needs a CUDA GPU")
    ranks = write_plan(tmp_path / "ranks", {"hardware": {"nproc_per_node": 2}})
    assert_one_line(engine([str(ranks)], tmp_path), 2, "plan is for 2 ranks", "1 were started")
    data = write_plan(
        tmp_path / "data", {"hardware": {"nproc_per_node": 1}, "data": {"paths": [str(tmp_path / "missing.txt")]}}
    )
    assert_one_line(engine([str(data)], tmp_path), 2, "data.paths", "does not exist")


def test_a_single_token_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    """data.kind tokens reads only `llmctl data prepare` folders: a plan naming a file of the older single-file
    format (FILE.bin + FILE.bin.json) fails at start, exit 2, with one line naming the file and the command."""
    from tests.engine.test_data import _old_token_file

    old = _old_token_file(tmp_path)
    plan = write_plan(
        tmp_path / "old", {"hardware": {"nproc_per_node": 1}, "data": {"kind": "tokens", "paths": [str(old)]}}
    )
    assert_one_line(
        engine([str(plan)], tmp_path), 2, f"data.paths: {old} is a single .bin token file", "llmctl data prepare"
    )


def test_data_is_checked_against_the_real_vocabulary_not_the_padded_one(tmp_path: Path) -> None:
    """A vocabulary that is not a multiple of pad_vocab_multiple (500 -> 512): synthetic tokens stay below 500 (they
    used to reach the padded rows and crash the loss with an IndexError), and a tokenizer larger than the real
    vocabulary is refused even when it fits the padded one (258 byte tokens, vocabulary 200 padded to 256)."""
    import json

    one = {"hardware": {"nproc_per_node": 1}, "training": {"max_steps": 2}}
    plan = write_plan(
        tmp_path / "synthetic",
        {**one, "data": {"kind": "synthetic", "paths": []}, "model": {"overrides": {"vocab_size": 500}}},
    )
    proc = engine([str(plan)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = json.loads((tmp_path / "synthetic" / "logs" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["vocab_size"] == 512
    plan = write_plan(tmp_path / "text", {**one, "model": {"overrides": {"vocab_size": 200}}})
    assert_one_line(engine([str(plan)], tmp_path), 2, "has 258 tokens", "vocabulary is 200")


@pytest.mark.slow
def test_one_plain_process_with_checkpointing_compile_and_bf16(tmp_path: Path) -> None:
    """The one test that compiles: one process (no torchrun), bf16 mixed precision, selective activation
    checkpointing (its op policy traced by torch.compile), per-layer torch.compile, the chunked loss, synthetic data;
    runs and writes finite losses."""
    import json

    from llmctl.engine.model import model_spec_for
    from llmctl.plan.flops import (
        attention_flops_per_token,
        hardware_flops_per_token,
        model_flops_per_token,
        recompute_attention_flops_per_token,
    )
    from llmctl.spec.planfile import load_plan

    # One layer: compile cost is per distinct layer graph, and this test is the slowest of the folder.
    plan = write_plan(
        tmp_path,
        {
            "hardware": {"nproc_per_node": 1},
            "data": {"kind": "synthetic", "paths": []},
            "model": {"overrides": {"num_hidden_layers": 1}},
            "training": {
                "max_steps": 3,
                "precision": "bf16-mixed",
                "compile": True,
                "activation_checkpointing": "selective",
                "loss_chunk_tokens": 48,
                "micro_batch_size": 2,
            },
        },
    )
    proc = engine([str(plan)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and 4 < r["loss"] < 7 for r in steps)
    spec = model_spec_for(load_plan(plan).model)
    # causal attention counted half in both (llmctl.plan.flops.CAUSAL_MFU), the re-run attention too
    half, rerun_half = (
        attention_flops_per_token(spec, 64) // 2,
        recompute_attention_flops_per_token(spec, 64, "selective") // 2,
    )
    model = model_flops_per_token(spec, 64) - half
    recompute = (hardware_flops_per_token(spec, 64, "selective", "sdpa", True) - half - rerun_half) / model
    assert 1 < recompute < 4 / 3
    assert steps[-1]["hardware_tflops_per_gpu"] == pytest.approx(
        steps[-1]["model_tflops_per_gpu"] * recompute, rel=1e-3
    )
    assert rows[0]["mesh"] == [1] and rows[0]["precision"] == "bf16-mixed"
    assert rows[0]["checkpointing"] == "selective" and rows[0]["loss_mode"] == "chunked"
