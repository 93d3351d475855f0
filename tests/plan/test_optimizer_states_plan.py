"""Optimizer states as a memory lever: the ledger's lines for fp32, bf16 and 8-bit moments (8-bit exact to torchao's
allocation: tests/engine/test_optimizer_states.py measures it), the planner using them only when asked, and the
`--optimizer-states` flag of estimate-memory and plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import DoesNotFitError
from llmctl.plan import memory as mem
from llmctl.plan import planner as pl
from llmctl.plan.emit import to_plan
from llmctl.plan.memory.ledger import _largest_rank_bytes, adam_8bit_rank_bytes
from llmctl.plan.request import build_request
from llmctl.spec.decisions import on_command
from llmctl.spec.models import from_hf_config, resolve_model
from llmctl.spec.planfile import load_plan, plan_to_yaml
from llmctl.spec.setup import TrainSetup
from tests.family_configs import LLAMA_256

runner = CliRunner()
TINY = LLAMA_256


def _opt_line(spec, **kw) -> mem.Component:
    est = mem.estimate(spec, TrainSetup(**kw))
    return next(c for c in est.components if c.name.startswith("optimizer states"))


def test_fp32_and_bf16_moments_are_8_and_4_bytes_a_parameter() -> None:
    spec = resolve_model("llama-3.1-8b")
    fp32 = _opt_line(spec, gpus_per_node=8)
    bf16 = _opt_line(spec, gpus_per_node=8, optimizer_states="bf16")
    assert (fp32.name, fp32.bytes) == ("optimizer states (adamw)", 8 * spec.params // 8)
    assert (bf16.name, bf16.bytes) == ("optimizer states (adamw, bf16)", 4 * spec.params // 8)
    # Pure bf16 already keeps bf16 moments (auto); fp32 moments over bf16 weights are asked for by name.
    assert _opt_line(spec, precision="bf16", gpus_per_node=8).bytes == bf16.bytes
    assert _opt_line(spec, precision="bf16", gpus_per_node=8, optimizer_states="fp32").bytes == fp32.bytes


def test_8bit_moments_of_a_small_llama_by_hand() -> None:
    """Two blocks: q and o 256 x 256, k and v 128 x 256, gate/up/down 688 x 256 quantized: per moment 1 B a value,
    4 B per 256-block, a 1 KiB code book; the four norms of 256 stay fp32 (4 + 4 B a value); embedding and head
    320 x 256 quantized."""
    spec = from_hf_config(TINY, name="tiny")

    def q(n: int) -> int:
        return 2 * (n + 4 * (n // 256) + 1024)

    block = 2 * (2 * 256 * 4) + 2 * q(65536) + 2 * q(32768) + 3 * q(688 * 256)
    total = 2 * block + 2 * q(320 * 256) + 2 * 256 * 4
    assert total == 3_321_088  # what AdamW8bit allocated on one rank (tests/engine/test_optimizer_states.py)
    line = _opt_line(spec, optimizer_states="8bit")
    assert (line.name, line.bytes) == ("optimizer states (adamw, 8-bit block-wise)", total)


def test_the_largest_rank_is_not_always_the_first() -> None:
    """31 rows of 256 over 2 ranks: rank 0's 16 rows (4,096 values) are quantized, rank 1's 15 (3,840) are not and
    hold three times the bytes."""
    assert _largest_rank_bytes([((31, 256), 1)], 2, 4) == 2 * 3840 * 4
    assert _largest_rank_bytes([((32, 256), 1)], 2, 4) == 2 * (4096 + 4 * 16 + 1024)
    assert _largest_rank_bytes([((3, 4096), 1)], 8, 4) == 2 * (4096 + 4 * 16 + 1024)  # 5 ranks with no row


def test_8bit_llama_31_8b_over_8_gpus() -> None:
    """Every tensor's shard quantized but the norms (4,096 / 8 = 512 values): measured on llama-3.1-8b's shapes in
    tests/engine/test_optimizer_states.py (two blocks; all 32 here)."""
    spec = resolve_model("llama-3.1-8b")
    got = adam_8bit_rank_bytes(spec, TrainSetup(optimizer_states="8bit", gpus_per_node=8))
    assert got == 2_039_595_008
    assert got / (spec.params / 8) == pytest.approx(2 + 8 / 256, abs=2e-3)
    # A model measured on fake tensors (no tensor shapes) or a bare count: every value quantized, code books aside.
    assert mem.state_ledger(resolve_model(None, "7B"), TrainSetup(optimizer_states="8bit"))[-1].bytes_per_param == (
        2 + 8 / 256
    )


def _request(model: str, gpu: str, gpus: int, states: str | None, **extra):
    options = {
        "params": None,
        "gpu": gpu,
        "gpus": gpus,
        "nodes": None,
        "gpus_per_node": None,
        "cluster": None,
        "net": None,
        "intra_gbps": None,
        "inter_gbps": None,
        "seq_len": 1024,
        "global_batch": None,
        "global_batch_tokens": None,
        "tokens": None,
        "price": None,
        "objective": "throughput",
        "precision": "auto",
        "loss_chunk": None,
        "attention": None,
        "overlap": 0.8,
        "calibrate": None,
        "memory_margin": 0.0,
        **extra,
    }
    if states is not None:
        options["optimizer_states"] = states
    names = {d.param: d.name for d in on_command(TrainSetup, "plan")}
    decisions = {names[k]: options.pop(k) for k in list(options) if k in names}
    return build_request(model, options, decisions)[0]


def test_the_planner_uses_smaller_states_only_when_asked() -> None:
    """llama-3.2-1b on one L4: 16 bytes a parameter of model states do not fit 24 GB; 8-bit moments do. The planner
    does not reach for them by itself (the mutant that searches over states would fit here): without CPU offload
    (pinned off) nothing fits, and unpinned it offloads instead (the lever it does reach for: test_offload.py)."""
    with pytest.raises(DoesNotFitError):
        pl.plan(_request("llama-3.2-1b", "L4", 1, None, offload=False))
    offloaded = pl.plan(_request("llama-3.2-1b", "L4", 1, None))
    assert {(c.setup.optimizer_states, c.setup.levers.offload) for c in offloaded.candidates} == {("auto", True)}
    for states in ("bf16", "8bit"):
        result = pl.plan(_request("llama-3.2-1b", "L4", 1, states))
        assert {c.setup.optimizer_states for c in result.candidates} == {states}
        plan = to_plan(result)
        assert plan.optimizer.states == states and f"  states: {states}\n" in plan_to_yaml(plan)


def test_without_the_flag_no_candidate_has_smaller_states() -> None:
    """llama-3.1-8b on 4 x A100-40GB fits either way, and 8-bit moments would be faster (a micro-batch of 2): the
    planner's choice keeps the precision's own states all the same."""
    free = pl.plan(_request("llama-3.1-8b", "A100-40GB", 4, None, seq_len=2048))
    asked = pl.plan(_request("llama-3.1-8b", "A100-40GB", 4, "8bit", seq_len=2048))
    assert {c.setup.optimizer_states for c in free.candidates} == {"auto"}
    assert asked.chosen.predicted.tokens_per_s > free.chosen.predicted.tokens_per_s
    assert "states" not in plan_to_yaml(to_plan(free))


def test_estimate_shows_the_line_and_the_caveat_with_its_source() -> None:
    r = runner.invoke(app, ["estimate-memory", "llama-3.1-8b", "--gpus", "8", "--optimizer-states", "8bit"])
    assert r.exit_code == 0, r.output
    assert "optimizer states (adamw, 8-bit block-wise)" in r.output
    assert "note: --optimizer-states 8bit: " in r.output and "https://arxiv.org/abs/2110.02861" in r.output
    r = runner.invoke(app, ["estimate-memory", "llama-3.1-8b", "--optimizer-states", "bf16", "--json"])
    d = json.loads(r.stdout)
    assert d["setup"]["optimizer_states"] == "bf16" and d["ledger"][-1]["bytes_per_param"] == 4
    assert "arxiv.org/abs/2010.06192" in r.stderr
    plain = json.loads(runner.invoke(app, ["estimate-memory", "llama-3.1-8b", "--json"]).stdout)
    assert "optimizer_states" not in plain["setup"]  # the answers of runs that do not ask are as they were


def test_plan_writes_the_states_and_prints_the_caveat(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    args = ["plan", "llama-3.2-1b", "--gpu", "L4", "--gpus", "1", "--seq-len", "1024", "--synthetic", "-o", str(out)]
    r = runner.invoke(app, [*args, "--optimizer-states", "8bit", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert "Dettmers et al. 2022" in d["optimizer_states_note"] and "2110.02861" in r.stderr
    assert load_plan(out).optimizer.states == "8bit"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["estimate-memory", "llama-tiny", "--optimizer-states", "int4"], "unknown optimizer states 'int4'"),
        (
            ["estimate-memory", "llama-tiny", "--optimizer", "lion", "--optimizer-states", "bf16"],
            "optimizer states bf16 apply to adamw's two moments, not lion",
        ),
        (["plan", "llama-tiny", "--gpu", "L4", "--optimizer-states", "fp8", "--no-write"], "unknown optimizer states"),
    ],
)
def test_bad_states_are_one_line_exit_2(args, needle) -> None:
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("llmctl: error: ") and needle in lines[0], r.output
