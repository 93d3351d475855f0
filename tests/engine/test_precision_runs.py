"""fp16-mixed with dynamic loss scaling and float8 training, run by the engine under torchrun (2 ranks, gloo, FSDP2),
all in one launch of tests/engine/engine_runs.py:

- fp16: 30 steps; at step 4 rank 1's first micro-batch loss is multiplied by 1e30 (LLMCTL_ENGINE_TEST_OVERFLOW) so
  its fp16 backward overflows on that rank only. Every rank skips step 4, the scale halves, the loss keeps falling.
  The same run in three legs (saved after steps 3 and 4, resumed each time) gives the same losses bit for bit, the
  same scale, and the step-4 checkpoint holds exactly the step-3 weights and optimizer state (nothing was updated).
- bf16 and 8-bit (torchao AdamW8bit) optimizer states (optimizer.states): trained 8 steps, and in two legs resumed
  after step 6 with the same losses bit for bit (the moments come back from DCP as they were saved, bf16 or 8-bit).
- CPU offload (FSDP2's CPUOffloadPolicy; on a CPU the copies are host to host, so the run is bf16-mixed's bit for
  bit): the same losses, and a resume from its checkpoint too.
- fp8 tensorwise (float8 all-gather) and rowwise against bf16-mixed: their losses follow bf16's within float8's
  error; tensorwise resumes from its checkpoint bit for bit (the float8 weights go through DCP), and gives the same
  losses under selective activation checkpointing.
- fp8 with tensor parallelism: tp 2 on 2 ranks (tensorwise on torchao's float8 TP styles, rowwise on torch's) trains
  as tp 1 on one rank with the same batches (the MLP 128 wide, so that it converts too), and tensorwise at tp 2
  resumes from its checkpoint bit for bit.

A constant learning rate after warm-up (min_lr_ratio 1) keeps the schedule independent of each leg's length.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import check_ok, losses, records, run_engine_plans, write_plan

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")
pytest.importorskip("torchao", reason="needs torchao (pip install 'llmctl[fp8]')")

pytestmark = pytest.mark.dist

OVERFLOW_STEP = 4


def _plan(
    root: Path,
    name: str,
    precision: str,
    steps: int,
    ckpt: str | None = None,
    ac: str = "none",
    states: str = "auto",
    offload: bool = False,
    tp: int = 0,
) -> Path:
    over: dict[str, Any] = {
        "parallel": {"offload": offload},
        "training": {"precision": precision, "max_steps": steps, "activation_checkpointing": ac},
        "optimizer": {"min_lr_ratio": 1.0, "states": states},
    }
    if tp:  # tp ranks on one data-parallel rank (tp 1: one rank), the MLP 128 wide so that float8 converts it
        over.update(hardware={"nproc_per_node": tp}, model={"overrides": {"intermediate_size": 128}})
        over["parallel"]["tp"] = tp
    if ckpt:
        over["checkpoint"] = {"dir": str(root / ckpt), "interval_steps": 1000, "keep_last": 10}
    return write_plan(root / name, over)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("precision")
    plans = {
        "fp16": _plan(root, "fp16", "fp16", 30),
        "fp16-a": _plan(root, "fp16-a", "fp16", OVERFLOW_STEP - 1, "fp16-ckpt"),
        "fp16-b": _plan(root, "fp16-b", "fp16", OVERFLOW_STEP, "fp16-ckpt"),
        "fp16-c": _plan(root, "fp16-c", "fp16", 30, "fp16-ckpt"),
        "bf16": _plan(root, "bf16", "bf16-mixed", 8),
        "fp8": _plan(root, "fp8", "fp8", 8),
        "fp8-a": _plan(root, "fp8-a", "fp8", 4, "fp8-ckpt"),
        "fp8-b": _plan(root, "fp8-b", "fp8", 8, "fp8-ckpt"),
        "fp8-rowwise": _plan(root, "fp8-rowwise", "fp8-rowwise", 8),
        "fp8-selective": _plan(root, "fp8-selective", "fp8", 8, ac="selective"),
        **{
            f"{precision}-tp{tp}": _plan(root, f"{precision}-tp{tp}", precision, 5, tp=tp)
            for precision in ("fp8", "fp8-rowwise")
            for tp in (1, 2)
        },
        "fp8-tp2-a": _plan(root, "fp8-tp2-a", "fp8", 3, "fp8-tp2-ckpt", tp=2),
        "fp8-tp2-b": _plan(root, "fp8-tp2-b", "fp8", 5, "fp8-tp2-ckpt", tp=2),
        "bf16-offload": _plan(root, "bf16-offload", "bf16-mixed", 8, offload=True),
        "bf16-offload-a": _plan(root, "bf16-offload-a", "bf16-mixed", 4, "offload-ckpt", offload=True),
        "bf16-offload-b": _plan(root, "bf16-offload-b", "bf16-mixed", 8, "offload-ckpt", offload=True),
        **{
            f"{states}-states{leg}": _plan(root, f"{states}-states{leg}", "fp32", steps, ckpt, states=states)
            for states in ("bf16", "8bit")
            for leg, steps, ckpt in (("", 8, None), ("-a", 6, f"{states}-ckpt"), ("-b", 8, f"{states}-ckpt"))
        },
    }
    procs = run_engine_plans(
        list(plans.values()), 2, root, extra_env={"LLMCTL_ENGINE_TEST_OVERFLOW": f"{OVERFLOW_STEP}:1"}, timeout=900
    )
    for p in plans.values():
        check_ok(procs[p])
    return {**plans, "root": root, "_logs": {p: procs[p].stderr.splitlines() for p in plans.values()}}


def test_fp16_skips_the_overflowed_step_on_every_rank_and_keeps_training(runs: dict[str, Path]) -> None:
    steps = {r["step"]: r for r in records(runs["fp16"], "step")}
    assert sorted(steps) == list(range(1, 31))
    start = records(runs["fp16"], "start")[0]
    assert start["precision"] == "fp16-mixed" and start["loss_scale"] == 2.0**16 and start["float8"] is None
    for k, r in steps.items():
        assert r["skipped"] == (k == OVERFLOW_STEP), k
        assert r["skipped_steps"] == (k >= OVERFLOW_STEP), k
        assert r["loss_scale"] == (2.0**15 if k >= OVERFLOW_STEP else 2.0**16), k  # 2000 clean steps to grow
        assert math.isfinite(r["loss"])
        assert (r["grad_norm"] is None) == (k == OVERFLOW_STEP), k
    # The norm is the unscaled gradients' (a scaled one would be 2**15 times larger).
    assert 0 < steps[OVERFLOW_STEP + 1]["grad_norm"] < 100
    first = sum(steps[k]["loss"] for k in (1, 2, 3)) / 3
    last = sum(steps[k]["loss"] for k in (28, 29, 30)) / 3
    assert first > 5.0 and last < first - 1.0, (first, last)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the checkpoints read back in this process
def test_fp16_resume_is_bit_exact_and_the_skipped_step_changed_nothing(runs: dict[str, Path]) -> None:
    ref = losses(runs["fp16"])
    legs = {k: v for name in ("fp16-a", "fp16-b", "fp16-c") for k, v in losses(runs[name]).items()}
    assert sorted(legs) == sorted(ref)
    for k in ref:
        assert legs[k] == ref[k], (k, legs[k], ref[k])
    last = records(runs["fp16-c"], "step")[-1]
    assert last["loss_scale"] == 2.0**15 and last["skipped_steps"] == 1  # the scale came back from the checkpoint
    assert records(runs["fp16-c"], "start")[0]["loss_scale"] == 2.0**15

    import torch.distributed.checkpoint as dcp

    def saved(step: int) -> dict[str, torch.Tensor]:
        path = runs["root"] / "fp16-ckpt" / f"step_{step:08d}"
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        tensors = {k: m for k, m in meta.state_dict_metadata.items() if hasattr(m, "size")}
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in tensors.items()}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        return state

    before, after = saved(OVERFLOW_STEP - 1), saved(OVERFLOW_STEP)
    assert sorted(before) == sorted(after)
    assert any(k.startswith("model.") for k in before) and any(k.endswith(".exp_avg_sq") for k in before)
    for k in before:
        assert torch.equal(before[k], after[k]), k  # weights, Adam's moments and its step count: untouched
    trainer = torch.load(runs["root"] / "fp16-ckpt" / f"step_{OVERFLOW_STEP:08d}" / "trainer.pt", weights_only=True)
    assert trainer["loss_scaler"]["scale"] == 2.0**15 and trainer["loss_scaler"]["skipped_steps"] == 1


def test_float8_trains_like_bf16_and_resumes_bit_exact(runs: dict[str, Path]) -> None:
    bf16 = losses(runs["bf16"])
    for name, gather in (("fp8", 8), ("fp8-rowwise", 0)):
        got = losses(runs[name])
        assert sorted(got) == sorted(bf16) == list(range(1, 9))
        # float8's e4m3 keeps 3 mantissa bits: per-step losses stay within a few percent of bf16's, and they fall
        for k in bf16:
            assert abs(got[k] - bf16[k]) < 0.05 * bf16[k], (name, k, got[k], bf16[k])
        assert got[8] < got[1] - 0.5
        assert got != bf16  # the float8 matmuls did run (bf16 would give the same losses bit for bit)
        f8 = records(runs[name], "start")[0]["float8"]
        # q, k, v, o of both layers (64 wide); the MLP's 172 and the LM head stay in bf16
        assert f8["float8_layers"] == 8 and f8["float8_all_gather_layers"] == gather  # tensorwise only
        assert f8["kept"]["lm_head"] == "LM head"
        assert all("loss_scale" not in r for r in records(runs[name], "step"))  # no scaler outside fp16
    ref = losses(runs["fp8"])
    legs = {k: v for name in ("fp8-a", "fp8-b") for k, v in losses(runs[name]).items()}
    assert legs == ref
    # Selective checkpointing keeps every other _scaled_mm output and recomputes the rest with the same dynamic
    # scales: the same losses as without checkpointing.
    assert losses(runs["fp8-selective"]) == ref


@pytest.mark.parametrize("precision", ["fp8", "fp8-rowwise"])
def test_float8_with_tensor_parallelism_trains_as_at_tp_1(runs: dict[str, Any], precision: str) -> None:
    """tp 2 against tp 1 on the same batches: the float8 scales are the same (an amax over the whole tp group), the
    matmuls' bf16 sums are split differently, and a rounding difference that moves a value across a float8 step
    shows: measured within 2e-4 of the loss over 5 steps (float8 against bf16 differs by up to 1e-3)."""
    one, two = losses(runs[f"{precision}-tp1"]), losses(runs[f"{precision}-tp2"])
    assert sorted(one) == sorted(two) == list(range(1, 6))
    for k in one:
        assert abs(two[k] - one[k]) <= 5e-4 * one[k], (precision, k, two[k], one[k])
    assert one[5] < one[1] - 0.5
    f8 = records(runs[f"{precision}-tp2"], "start")[0]["float8"]
    assert f8["float8_layers"] == 14  # q, k, v, o, gate, up, down of both layers
    assert f8["float8_all_gather_layers"] == (14 if precision == "fp8" else 0)
    # tensorwise: the 14 linears on torchao's float8 styles (cast before TP's all-gather); rowwise: torch's own
    said = [m for m in runs["_logs"][runs[f"{precision}-tp2"]] if m.startswith("tensor parallel:")]
    assert said == [
        "tensor parallel: tp 2, llama plan over 2 layers"
        + (", 14 float8 linear layers on torchao's float8 styles" if precision == "fp8" else "")
    ]
    if precision == "fp8":
        legs = {k: v for name in ("fp8-tp2-a", "fp8-tp2-b") for k, v in losses(runs[name]).items()}
        assert legs == two  # the float8 DTensor weights through DCP and back


@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_smaller_optimizer_states_train_and_resume_bit_exact(runs: dict[str, Path], states: str) -> None:
    ref = losses(runs[f"{states}-states"])
    assert sorted(ref) == list(range(1, 9)) and ref[8] < ref[1] - 0.5
    legs = {k: v for leg in ("-a", "-b") for k, v in losses(runs[f"{states}-states{leg}"]).items()}
    assert legs == ref
    assert records(runs[f"{states}-states-b"], "start")[0]["step"] == 6


def test_cpu_offload_runs_the_same_training_and_resumes(runs: dict[str, Path]) -> None:
    """FSDP2 with CPUOffloadPolicy (sharded parameters, gradients, optimizer step on the host; unpinned without a
    GPU) trains exactly as without it, checkpoints and resumes; the start event says so. The GPU path (pinned
    copies, buffers on the device) is the GPU tier's."""
    ref = losses(runs["bf16"])
    assert losses(runs["bf16-offload"]) == ref
    legs = {k: v for leg in ("-a", "-b") for k, v in losses(runs[f"bf16-offload{leg}"]).items()}
    assert legs == ref
    assert records(runs["bf16-offload"], "start")[0]["offload"] is True
    assert records(runs["bf16"], "start")[0]["offload"] is False
