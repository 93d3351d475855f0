"""A hung run names its stuck rank (issue 50), on 2 real gloo ranks: rank 1 sleeps in the data phase of step 5 (the
engine's test hook), rank 0 waits for it in a collective. `llmctl status` says STALLED within the plan's limit and names
rank 1 and its phase; `status --stacks` shows rank 1 in the hook's sleep and rank 0 in torch; the launcher warns once;
the run then ends by the plan's collective timeout with one line per rank (no traceback) and its checkpoint of step 4
intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from launch_helpers import TINY_PLAN
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import heartbeat


def _status(*args: str) -> str:
    r = CliRunner().invoke(app, ["status", *args])
    return r.output


@pytest.mark.dist
def test_a_stalled_rank_is_named_and_the_run_ends_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    plan = yaml.safe_load(TINY_PLAN.read_text())
    plan["training"]["max_steps"] = 6
    plan["data"]["paths"] = [str(TINY_PLAN.parent / p) for p in plan["data"]["paths"]]  # relative to the plan
    plan["checkpoint"] = {"dir": str(tmp_path / "run" / "ckpt"), "interval_steps": 2, "keep_last": 2}
    plan["logging"] = {"dir": str(tmp_path / "run"), "interval_steps": 1}
    plan["watchdog"] = {"stall_factor": 3, "stall_floor_s": 4, "collective_timeout_s": 25}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    env = {**os.environ, "LLMCTL_TEST_STALL": "1:5:120"}
    launch = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "launch", "plan.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stalled, t0 = "", time.monotonic()
        while time.monotonic() - t0 < 180 and launch.poll() is None:
            out = _status()
            if "STALLED" in out:
                stalled = out
                break
            time.sleep(0.5)
        assert stalled, f"never STALLED: {_status()}"
        print(stalled)  # the docs (docs/how-to/hangs.md) show this output
        beats = {b.rank: b for b in heartbeat.read_all(tmp_path / "run")}
        assert (beats[1].phase, beats[1].step) == ("data", 4)  # rank 1 finished step 4, sleeps before step 5's data
        assert beats[0].place > beats[1].place  # rank 0 went on into step 5 and waits for it
        assert "behind: rank 1 (" in stalled and "in data of step 5" in stalled and "ranks 0 wait for it" in stalled
        job = next(line.split()[0] for line in stalled.splitlines() if "local-" in line and "STALLED" in line)
        stacks = _status(job, "--stacks")
        assert "== rank 1 ==" in stacks and "watchdog.py" in stacks and "in data" in stacks, stacks
        assert "== rank 0 ==" in stacks and "torch" in stacks.split("== rank 0 ==")[1], stacks
        out, err = launch.communicate(timeout=240)
        print(err[-1500:])
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert launch.returncode != 0
    assert "llmctl: warning: STALLED" in err and err.count("llmctl: warning: STALLED") == 1
    assert "rank 0: a collective waited more than 25 s in " in err, err[-3000:]
    assert "Traceback" not in err.split("STALLED", 1)[1], err[-4000:]
    marker = tmp_path / "run" / "ckpt" / "step_00000004" / "llmctl-checkpoint.json"
    assert marker.is_file() and json.loads(marker.read_text())
