"""The heartbeat diagnosis, the stack grouping, torchrun's traceback left off the terminal and the watchdog's plan
section, without ranks (the real 2-rank stall is tests/launch/test_stall.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmctl.engine.watchdog import Watchdog, collective_failure
from llmctl.launch import heartbeat
from llmctl.launch.heartbeat import Beat, diagnose
from llmctl.launch.local import AgentTraceback
from llmctl.spec.planfile import WatchdogSection, load_plan, plan_from_dict, plan_to_yaml


def beat(rank: int, step: int, phase: str, since: float, step_s: float | None = 1.0) -> Beat:
    return Beat(rank, step, phase, since, "h", 100 + rank, step_s)


def test_moving_run_is_not_stalled():
    d = diagnose([beat(0, 4, "forward", 99.0), beat(1, 4, "backward", 98.5)], now=100.0, floor_s=2)
    assert d is not None and not d.stalled and d.limit_s == 3.0  # 3 x the measured 1 s step


def test_stalled_run_names_the_rank_behind_and_who_waits():
    beats = [beat(0, 4, "forward", 90.0), beat(1, 4, "data", 80.0), beat(2, 4, "forward", 90.5)]
    d = diagnose(beats, now=100.0, floor_s=2)
    assert d.stalled and d.quiet_s == pytest.approx(9.5)
    assert [b.rank for b in d.behind] == [1] and [b.rank for b in d.ahead] == [0, 2]
    line = d.line()
    assert "behind: rank 1 (h, pid 101) in data of step 5" in line and "ranks 0, 2 wait for it in forward" in line


def test_the_floor_and_the_planned_step_time_set_the_limit():
    beats = [beat(0, 0, "setup", 0.0, None)]
    assert diagnose(beats, now=50.0, planned_step_s=None, floor_s=60).stalled is False  # start-up: the floor
    assert diagnose(beats, now=50.0, planned_step_s=30.0, floor_s=10).limit_s == 90.0  # 3 x the plan's 30 s
    assert diagnose(beats, now=50.0, planned_step_s=30.0, floor_s=10, factor=1.5).limit_s == 45.0
    assert diagnose([], now=1.0) is None


def test_ranks_at_one_place_are_left_to_the_stacks():
    d = diagnose([beat(0, 2, "backward", 0.0), beat(1, 2, "backward", 0.0)], now=100.0, floor_s=2)
    assert d.stalled and not d.ahead and "every rank is at the same place" in d.line()


def test_writer_measures_the_step_time_and_replaces_its_file(tmp_path):
    w = heartbeat.Writer(tmp_path, 3)
    w.beat("data", 0)
    w.beat("forward")
    w.beat("data", 1)
    w.beat("data", 2)
    got = heartbeat.read_all(tmp_path)
    assert [(b.rank, b.step, b.phase) for b in got] == [(3, 2, "data")] and got[0].step_s is not None
    assert not list((tmp_path / heartbeat.DIR).glob(".*tmp"))  # written whole, renamed over


def test_group_stacks_lists_equal_stacks_once_odd_one_first():
    wait = 'Thread 0x01 (most recent call first):\n  File "torch/x.py", line 3 in wait\n'
    sleep = 'Current thread 0x02 (most recent call first):\n  File "watchdog.py", line 9 in data\n'
    groups = heartbeat.group_stacks({0: wait, 1: sleep, 2: wait.replace("0x01", "0x07")})
    assert [ranks for ranks, _ in groups] == [[1], [0, 2]]


def test_torchrun_traceback_is_left_off_the_terminal():
    lines = [
        b"step 4/6\n",
        b"Traceback (most recent call last):\n",
        b'  File "/v/bin/torchrun", line 6, in <module>\n',
        b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
        b"=" * 60 + b"\n",
        b"llmctl.engine FAILED\n",
        b"=" * 60 + b"\n",
        b"after\n",
        b"Traceback (most recent call last):\n",  # a rank's own traceback (a bug) stays
        b'  File "/repo/llmctl/engine/loop.py", line 3, in run\n',
    ]
    f = AgentTraceback()
    shown = [x for line in lines for x in f.filter(line)]
    assert shown == [lines[0], b"after\n", lines[8], lines[9]]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("[gloo/transport/tcp/pair.cc:1] Timed out waiting 25000ms for recv operation", "a collective waited more"),
        ("[gloo/transport/tcp/pair.cc:2] Connection closed by peer [127.0.0.1]:1", "another rank left"),
    ],
)
def test_collective_failures_are_one_line(text, want):
    e = collective_failure(RuntimeError(text), 0, "in forward of step 5", 25.0)
    assert e is not None and want in e.message and e.message.startswith("rank 0: ") and "\n" not in str(e)
    assert collective_failure(RuntimeError(text), 1, "x", 1.0).message.startswith(want[:5])
    assert collective_failure(RuntimeError("CUDA out of memory"), 0, "x", 1.0) is None
    assert collective_failure(ValueError(text), 0, "x", 1.0) is None


def test_the_stall_hook_sleeps_only_its_rank_and_leaves_on_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_TEST_STALL", "1:3:30")
    w0, w1 = Watchdog(tmp_path, 0), Watchdog(tmp_path, 1)
    try:
        w0.data(2, lambda: False)  # rank 0: no sleep
        w1.data(1, lambda: True)  # step 2: not the hook's
        w1.data(2, lambda: True)  # step 3, rank 1: leaves at once when asked to stop
        assert (w1.beats.step, w1.beats.phase) == (2, "data") and w1.where() == "in data of step 3"
    finally:
        w0.close()
        w1.close()


def test_the_watchdog_section_is_written_only_when_set(tmp_path):
    from launch_helpers import minimal_plan_yaml

    plan = plan_from_dict(__import__("yaml").safe_load(minimal_plan_yaml()), "t")
    assert "watchdog" not in plan_to_yaml(plan)
    assert plan.watchdog.timeout_s(None) == 600.0 and plan.watchdog.timeout_s(120.0) == 1200.0
    data = json.loads(json.dumps(plan.model_dump(mode="json")))
    data["watchdog"]["collective_timeout_s"] = 30
    moved = plan_from_dict(data, "t")
    (tmp_path / "p.yaml").write_text(plan_to_yaml(moved))
    assert load_plan(tmp_path / "p.yaml").watchdog == WatchdogSection(collective_timeout_s=30)


def test_ranks_waiting_in_different_collectives_are_named() -> None:
    """The stacks of a real hang (examples/moe-cpu.yaml before its fix: rank 1 skipped the dispatch's backward
    all-to-all, so rank 0 waited in it while rank 1 waited in FSDP's reduce-scatter): each rank's collective is named
    and the mismatch is one line; ranks in the same collective, or stacks without one, say nothing."""
    data = Path(__file__).parent / "data"
    texts = {r: (data / f"stack-ep-hang-rank{r}.txt").read_text() for r in (0, 1)}
    assert heartbeat.waiting_in(texts[0]) == "all_to_all_single_backward"
    assert heartbeat.waiting_in(texts[1]) == "reduce_scatter_single"
    why = heartbeat.mismatch(heartbeat.group_stacks(texts))
    assert why == (
        "the ranks wait in different collectives (rank 0 in all_to_all_single_backward; rank 1 in "
        "reduce_scatter_single): a collective that did not match"
    )
    assert heartbeat.mismatch(heartbeat.group_stacks({0: texts[0], 1: texts[0]})) is None
    idle = 'Current thread 0x1 (most recent call first):\n  File "x.py", line 1 in sleep\n'
    assert heartbeat.waiting_in(idle) is None
    assert heartbeat.mismatch(heartbeat.group_stacks({0: texts[0], 1: idle})) is None
