"""LoRA and QLoRA on one rank run without FSDP2 (issue 47: llmctl.spec.setup.fsdp_wraps), under torch.autocast to
the compute dtype, and train exactly as FSDP2 on one rank did: the same losses and gradient norms, bit for bit, in
bf16-mixed. QLoRA trains too (FSDP2 on a world of one crashed in torchao's NF4 all-gather: "not enough values to
unpack"). The estimate for such a run has no FSDP2 copies and the planner prices none.

One process runs the three plans (tests/engine/one_rank_runs.py), no torchrun."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from llmctl.plan import memory as mem
from llmctl.plan.kernel_time import fsdp_copy_bytes
from llmctl.spec import models
from llmctl.spec.finetune import Finetune
from llmctl.spec.setup import TrainSetup
from tests.engine.conftest import REPO, engine_env, records, write_plan

ADAPTED = {
    "hardware": {"nproc_per_node": 1},
    "training": {"precision": "bf16-mixed", "grad_accum_steps": 2, "max_steps": 3, "activation_checkpointing": "full"},
    "finetune": {"method": "lora", "lora_rank": 8},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("one-rank")
    plans = {
        "lora": write_plan(root / "lora", ADAPTED),
        "lora-fsdp": write_plan(root / "lora-fsdp", ADAPTED),
        "qlora": write_plan(root / "qlora", {**ADAPTED, "finetune": {"method": "qlora", "lora_rank": 8}}),
    }
    args = [str(plans["lora"]), f"fsdp:{plans['lora-fsdp']}", str(plans["qlora"])]
    out = root / "codes.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "engine" / "one_rank_runs.py"), str(out), *args],
        cwd=REPO,
        env=engine_env(root),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stderr[-4000:]
    codes = json.loads(out.read_text())
    assert all(c == 0 for c in codes.values()), (codes, proc.stderr[-4000:])
    return plans


def test_lora_on_one_rank_runs_without_fsdp_and_trains_as_fsdp_did(runs: dict[str, Path]) -> None:
    start, forced = records(runs["lora"], "start")[0], records(runs["lora-fsdp"], "start")[0]
    assert start["fsdp2"] is False and forced["fsdp2"] is True
    got = [(r["loss"], r["grad_norm"]) for r in records(runs["lora"], "step")]
    want = [(r["loss"], r["grad_norm"]) for r in records(runs["lora-fsdp"], "step")]
    assert len(got) == 3 and got == want  # autocast does what FSDP2's mixed-precision policy did, bit for bit
    assert got[-1][0] < got[0][0]


def test_qlora_on_one_rank_trains(runs: dict[str, Path]) -> None:
    start = records(runs["qlora"], "start")[0]
    assert start["fsdp2"] is False and start["finetune"].startswith("qlora")
    steps = records(runs["qlora"], "step")
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in steps)


def _setup(gpus: int, method: str, precision: str = "bf16-mixed") -> TrainSetup:
    ft = Finetune(method) if method != "full" else Finetune()
    return TrainSetup(precision=precision, gpus_per_node=gpus, micro_batch_size=2, checkpointing="full", finetune=ft)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_estimate_and_the_timing_have_no_fsdp_copies_on_one_rank_with_adapters(method: str) -> None:
    spec = models.resolve_model("llama-3.1-8b")
    one, two = mem.estimate(spec, _setup(1, method)), mem.estimate(spec, _setup(2, method))
    names = {c.name for c in one.components}
    assert not any(n.startswith("unsharded") for n in names)
    assert "adapters in the compute dtype (autocast)" in names
    assert any(n.startswith("unsharded") for n in {c.name for c in two.components})
    assert fsdp_copy_bytes(spec, _setup(1, method)) == 0 < fsdp_copy_bytes(spec, _setup(2, method))
    # full training on one rank in bf16-mixed keeps FSDP2 (its policy is how the fp32 masters meet bf16)
    full = mem.estimate(spec, _setup(1, "full"))
    assert any(c.name == "unsharded layers (FSDP2 on one rank)" for c in full.components)
    assert _setup(1, "full").fsdp_wraps and not _setup(1, method).fsdp_wraps and _setup(2, method).fsdp_wraps
