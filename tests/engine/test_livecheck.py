"""The engine's measured-vs-plan check: the verdict (pure), and one real 2-rank run whose plan is far off."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.engine.livecheck import Clues, judge
from llmctl.spec.planfile import Predicted
from tests.engine.conftest import check_ok, records, run_engine, write_plan

CPU = Clues("cpu", None)


def test_within_the_plan_is_ok_and_silent():
    v = judge(10, {"tokens_per_s": 800.0}, Predicted(tokens_per_s=1000.0), CPU)
    assert v.ok and v.record["tokens_per_s_ratio"] == pytest.approx(0.8)
    assert "message" not in v.record and v.record["event"] == "plan_check"


@pytest.mark.parametrize("tps,ok", [(701.0, True), (699.0, False)])
def test_slower_threshold(tps, ok):
    assert judge(10, {"tokens_per_s": tps}, Predicted(tokens_per_s=1000.0), CPU).ok is ok


def test_nothing_predicted_is_ok():
    assert judge(10, {"tokens_per_s": 1.0}, Predicted(), CPU).ok


def test_memory_is_judged_on_gpus_only():
    rec = {"tokens_per_s": 1000.0, "peak_mem_reserved_bytes": 12 * 2**30}
    pred = Predicted(tokens_per_s=1000.0, memory_per_gpu_bytes=10 * 2**30)
    v = judge(10, rec, pred, Clues("cuda", "H100-SXM"))
    assert not v.ok and "20% above the planned 10.0 GiB" in v.record["message"]
    assert judge(10, rec, pred, CPU).ok  # a CPU's RSS holds the interpreter: not comparable


def test_allocator_retries_are_a_warning_on_gpus():
    pred = Predicted(tokens_per_s=1000.0, memory_per_gpu_bytes=10 * 2**30)
    rec = {"tokens_per_s": 1000.0, "peak_mem_reserved_bytes": 9 * 2**30, "alloc_retries": 3}
    v = judge(10, rec, pred, Clues("cuda", "H100-SXM"))
    assert not v.ok and v.record["alloc_retries"] == 3
    assert "retried 3 allocations" in v.record["message"] and "--memory-margin" in v.record["message"]
    assert judge(10, {**rec, "alloc_retries": 0}, pred, Clues("cuda", "H100-SXM")).ok
    assert judge(10, rec, pred, CPU).ok


def test_causes_name_what_the_engine_saw():
    pred = Predicted(tokens_per_s=1000.0)
    v = judge(10, {"tokens_per_s": 100.0}, pred, Clues("cpu", "H100-SXM", data_wait_fraction=0.4, recompiles=2))
    causes = v.record["causes"]
    assert "no GPU (cpu)" in causes[0] and "H100-SXM" in causes[0]
    assert "40% of the step time waiting for batches" in causes[1]
    assert "recompiled 2 frames" in causes[2]
    assert "90% below the planned 1,000" in v.record["message"]
    plain = judge(10, {"tokens_per_s": 100.0}, pred, Clues("cuda", "H100-SXM"))
    assert len(plain.record["causes"]) == 1 and "bench-net" in plain.record["causes"][0]


def test_a_run_far_from_its_plan_warns_once(tmp_path: Path):
    # 8 steps; the check judges the first window starting 3 steps in; the plan promised 1e9 tokens/s.
    plan = write_plan(
        tmp_path,
        {
            "training": {"max_steps": 8},
            "logging": {"check_after_steps": 3},
            "predicted": {"tokens_per_s": 1.0e9, "mfu": 0.5},
        },
    )
    proc = run_engine(plan, 2, tmp_path)
    check_ok(proc)
    checks = records(plan, "plan_check")
    assert len(checks) == 1, checks
    c = checks[0]
    assert c["step"] == 4 and c["ok"] is False  # the window 3 -> 4: past warm-up
    assert c["tokens_per_s_predicted"] == 1.0e9 and 0 < c["tokens_per_s"] < 1.0e9
    assert c["tokens_per_s_ratio"] == pytest.approx(c["tokens_per_s"] / 1.0e9)
    assert "below the planned 1,000,000,000" in c["message"]
    assert proc.stdout.count("[plan_check]") == 1  # the warning, once
    step4 = next(r for r in records(plan, "step") if r["step"] == 4)
    assert step4["tokens_per_s"] == c["tokens_per_s"]


def test_a_run_on_plan_records_ok_without_a_message(tmp_path: Path):
    plan = write_plan(
        tmp_path,
        {"training": {"max_steps": 5}, "logging": {"check_after_steps": 2}, "predicted": {"tokens_per_s": 1.0}},
    )
    proc = run_engine(plan, 2, tmp_path)
    check_ok(proc)
    checks = records(plan, "plan_check")
    assert [c["ok"] for c in checks] == [True] and "message" not in checks[0]
    assert "[plan_check]" not in proc.stdout
