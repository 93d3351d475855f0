"""The heartbeat diagnosis, the stack grouping, torchrun's traceback left off the terminal and the watchdog's plan
section, without ranks (the real 2-rank stall is tests/launch/test_stall.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmctl.engine.watchdog import Watchdog, _stall_hook, collective_failure, flight_recorder_env
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


def test_writer_step_time_after_each_beat(tmp_path, monkeypatch):
    """The step time the heartbeat carries, after each beat of a step as the trainer gives them: a step's time runs
    from the beat that finished the previous step to the one that finishes it; the beats of the same step (the data
    phase of every accumulation micro-batch, eval, checkpoint) neither add a step time nor move its start; a beat
    that finishes several steps at once counts as that many steps; the median of the last 20."""
    now = [100.0]
    monkeypatch.setattr(heartbeat, "time", type("Clock", (), {"time": staticmethod(lambda: now[0])}))
    w = heartbeat.Writer(tmp_path, 0)

    def at(t: float, phase: str, step: int | None = None) -> tuple[int, str, float, float | None]:
        now[0] = t
        w.beat(phase, step)
        (b,) = heartbeat.read_all(tmp_path)
        return b.step, b.phase, b.since, b.step_s

    assert at(100.0, "data", 0) == (0, "data", 100.0, None)  # the first step starts
    assert at(101.0, "forward") == (0, "forward", 101.0, None)
    assert at(102.0, "data", 0) == (0, "data", 102.0, None)  # the second micro-batch of step 1
    assert at(110.0, "data", 1) == (1, "data", 110.0, 10.0)  # step 1 took 100 -> 110
    assert at(111.0, "checkpoint", 1) == (1, "checkpoint", 111.0, 10.0)  # same step: no new time
    assert at(114.0, "data", 1) == (1, "data", 114.0, 10.0)
    assert at(124.0, "data", 2) == (2, "data", 124.0, 12.0)  # 110 -> 124, not from the checkpoint's beat
    assert at(148.0, "data", 4) == (4, "data", 148.0, 12.0)  # two steps in 24 s: 12 each; median(10, 14, 12)
    assert w._steps_s == [10.0, 14.0, 12.0]
    for k in range(30):  # only the last 20 count
        at(148.0 + 2 * (k + 1), "data", 5 + k)
    assert heartbeat.read_all(tmp_path)[0].step_s == 2.0


def test_the_limit_follows_the_slowest_ranks_step_time():
    """Ranks measure their own step time; the limit is a multiple of the slowest one (a pipeline's last stage, a rank
    that also evaluates): at 10 s of quiet a run whose slowest rank steps in 4 s is moving."""
    beats = [beat(0, 4, "forward", 90.0, 1.0), beat(1, 4, "backward", 89.0, 4.0), beat(2, 4, "data", 88.0, None)]
    d = diagnose(beats, now=100.0, planned_step_s=50.0, floor_s=2)
    assert d.step_s == 4.0 and d.limit_s == 12.0 and d.quiet_s == 10.0 and not d.stalled
    assert diagnose(beats[2:], now=100.0, planned_step_s=50.0, floor_s=2).step_s == 50.0  # none measured: the plan


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
    """LLMCTL_TEST_STALL=1:3:30 is (step 3, 30 s) for rank 1 and nothing for rank 0; the sleep (the only caller of
    `stopping`) begins in the data phase of step 3 (after step 2 finished) and nowhere else."""
    monkeypatch.setenv("LLMCTL_TEST_STALL", "1:3:30")
    assert _stall_hook(1) == (3, 30.0) and _stall_hook(0) is None
    for bad in ("", "1:3", "x:3:30"):
        monkeypatch.setenv("LLMCTL_TEST_STALL", bad)
        assert _stall_hook(1) is None, bad
    monkeypatch.setenv("LLMCTL_TEST_STALL", "1:3:30")
    w0, w1 = Watchdog(tmp_path, 0), Watchdog(tmp_path, 1)
    asked: list[tuple[int, int]] = []

    def stopping(rank: int, step: int):
        return lambda: asked.append((rank, step)) is None  # asked to stop: leave at once

    try:
        for step in range(5):
            w0.data(step, stopping(0, step))
            w1.data(step, stopping(1, step))
            if step == 2:
                assert (w1.beats.step, w1.beats.phase) == (2, "data") and w1.where() == "in data of step 3"
        assert asked == [(1, 2)]
    finally:
        w0.close()
        w1.close()


def test_the_stacks_on_request_show_every_thread(tmp_path):
    """`status --stacks`'s path in one process: the rank's heartbeat gives its pid, SIGUSR2 makes the watchdog's
    faulthandler append every thread's stack to the rank's stacks file, request_stacks reads what was added. A rank
    stuck in a collective may be stuck in another thread than the main one (a data loader, a checkpoint writer): the
    parked thread's frame is in the dump, with the main thread's."""
    import threading

    release = threading.Event()

    def parked_in_a_collective() -> None:
        release.wait(30)

    w = Watchdog(tmp_path, 0)
    worker = threading.Thread(target=parked_in_a_collective, daemon=True)
    worker.start()
    try:
        w.beat("forward", 3)
        texts, missing = heartbeat.request_stacks(tmp_path, wait_s=5.0)
    finally:
        release.set()
        worker.join()
        w.close()
    assert missing == [] and list(texts) == [0]
    assert "parked_in_a_collective" in texts[0] and "test_the_stacks_on_request_show_every_thread" in texts[0]


def test_the_flight_recorder_env_is_set_unless_given(tmp_path, monkeypatch):
    """torch's flight recorder: 2,000 entries for gloo and NCCL; on NCCL also dumped on a timeout into
    <logging.dir>/flight/rank_N; a value the user set is kept."""
    nccl = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    for name in ("TORCH_FR_BUFFER_SIZE", *nccl):
        monkeypatch.setenv(name, "x")  # restored (unset) after the test
        monkeypatch.delenv(name)
    flight_recorder_env(tmp_path, "gloo")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000" and not any(n in os.environ for n in nccl)
    assert not (tmp_path / "flight").exists()  # gloo: dumped as JSON only when asked or on a timeout
    flight_recorder_env(tmp_path, "nccl")
    assert [os.environ[n] for n in nccl] == ["2000", "1", str(tmp_path / "flight" / "rank_")]
    assert (tmp_path / "flight").is_dir()
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    flight_recorder_env(tmp_path, "nccl")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"


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
