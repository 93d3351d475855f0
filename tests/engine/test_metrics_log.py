"""metrics.jsonl survives a kill mid-write (issue 46): the engine writes each line in one write (O_APPEND), and a
torn last line, the cut line a killed run leaves, is repaired when the next run opens the file, so that the next
run's first line is not glued to it and `plan --calibrate` still reads the file. Before, the two were glued into
one line that is not JSON, and calibrate refused the whole file (this test failed on main then).

Unit tests: the engine's MetricsLog on files written here, no torchrun."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from llmctl.engine.metrics import MetricsLog
from llmctl.fileio import repair_torn_tail, whole_lines_end
from llmctl.launch.local import _run_outcome
from llmctl.plan.calibrate import read_calibration


def step(n: int) -> dict[str, object]:
    return {
        "event": "step",
        "step": n,
        "loss": 5.0,
        "lr": 1e-3,
        "step_time_s": 0.1,
        "tokens_per_s": 1000.0 + n,
        "tokens_per_s_predicted": 2000.0,
    }


def killed_run(path: Path, steps: int) -> str:
    """A run's lines, the last one cut in the middle (SIGKILL in the write); returns the cut text."""
    lines = [json.dumps({"event": "start", "step": 0})] + [json.dumps(step(n)) for n in range(1, steps + 1)]
    torn = lines[-1][:25]
    path.write_text("\n".join(lines[:-1]) + "\n" + torn)
    return torn


def test_a_torn_tail_is_cut_before_the_next_run_appends(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    torn = killed_run(path, steps=4)
    offset = whole_lines_end(path)  # where the launcher starts reading this run's lines
    assert offset == path.stat().st_size - len(torn)

    with caplog.at_level(logging.WARNING):
        log = MetricsLog(path, total_steps=8, stream=io.StringIO())
    assert f"its last line ({len(torn)} bytes, a run killed mid-write) dropped" in caplog.text
    log.event({"event": "start", "step": 3})
    for n in (4, 5):
        log.event(step(n))
    log.event({"event": "stop", "step": 5})
    log.close()

    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses: nothing glued
    assert [r["event"] for r in records] == ["start", "step", "step", "step", "start", "step", "step", "stop"]
    assert path.read_text().endswith("\n")
    assert _run_outcome(str(path), offset)["stop"] == 5  # the launcher still finds this run's events

    calibration = read_calibration(str(path))  # `llmctl plan --calibrate metrics.jsonl`
    assert calibration.steps == 4 and calibration.predicted_tokens_per_s == 2000.0


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(step(1)) + "\n" + json.dumps(step(2)))  # cut between the object and its newline
    assert repair_torn_tail(path) == ("newline", len(json.dumps(step(2))))
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert repair_torn_tail(path) is None  # whole now: left alone
    assert repair_torn_tail(tmp_path / "missing.jsonl") is None
    path.write_text('{"event": "st')  # nothing whole at all
    assert repair_torn_tail(path) == ("dropped", 13) and path.read_bytes() == b""


def test_calibrate_skips_the_cut_last_line_of_a_killed_run(tmp_path: Path) -> None:
    """Before any new run repaired it: `plan --calibrate` reads the whole lines, and still refuses a bad line that is
    not the cut tail."""
    from llmctl.errors import SpecError

    path = tmp_path / "metrics.jsonl"
    killed_run(path, steps=4)
    assert read_calibration(str(path)).steps == 2  # steps 1-3 whole, the first left out as warm-up
    path.write_text(path.read_text().replace('{"event": "start", "step": 0}', "{oops"))
    with pytest.raises(SpecError, match="line 1: not valid JSON"):
        read_calibration(str(path))
