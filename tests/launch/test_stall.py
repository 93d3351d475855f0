"""A hung run names its stuck rank (issue 50), on 2 and 4 real gloo ranks: one rank sleeps in the data phase of step 5
(the engine's test hook), the others wait for it in a collective. `llmctl status` says STALLED within the plan's limit
and names that rank and its phase; `status --stacks` shows it in the hook's sleep and the others in torch, and the
flight recorders name the collective it did not enter and the ranks waiting in it; the launcher warns once; the run
then ends by the plan's collective timeout with one line per rank (no traceback), each rank's flight recorder dumped,
and its checkpoint of step 4 intact."""

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
from llmctl.launch.flight import read_dumps as flight_dumps


def _status(*args: str) -> str:
    r = CliRunner().invoke(app, ["status", *args])
    return r.output


def _stack_groups(text: str) -> list[tuple[str, str]]:
    """("rank 1" or "ranks 0, 3", the stack under it) of `status --stacks`'s "== ranks ... ==" sections."""
    parts = text.split("\n== ")[1:]
    return [(p.split(" ==", 1)[0].replace("ranks ", "rank "), p.split(" ==", 1)[1]) for p in parts]


@pytest.mark.dist
@pytest.mark.parametrize(
    ("nproc", "stuck", "parallel"),
    [(2, 1, {"sharding": "full_shard"}), (4, 2, {"sharding": "full_shard", "tp": 2})],
    ids=["2-ranks", "4-ranks-tp2"],
)
def test_a_stalled_rank_is_named_and_the_run_ends_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nproc: int, stuck: int, parallel: dict
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    plan = yaml.safe_load(TINY_PLAN.read_text())
    plan["training"]["max_steps"] = 6
    plan["data"]["paths"] = [str(TINY_PLAN.parent / p) for p in plan["data"]["paths"]]  # relative to the plan
    plan["checkpoint"] = {"dir": str(tmp_path / "run" / "ckpt"), "interval_steps": 2, "keep_last": 2}
    plan["logging"] = {"dir": str(tmp_path / "run"), "interval_steps": 1}
    plan["watchdog"] = {"stall_factor": 3, "stall_floor_s": 4, "collective_timeout_s": 25}
    plan["hardware"]["nproc_per_node"] = nproc
    plan["parallel"] = parallel
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    env = {**os.environ, "LLMCTL_TEST_STALL": f"{stuck}:5:120"}
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
        others = sorted(set(range(nproc)) - {stuck})
        assert (beats[stuck].phase, beats[stuck].step) == ("data", 4)  # finished step 4, sleeps before step 5's data
        assert all(beats[r].place > beats[stuck].place for r in others)  # the others went on into step 5 and wait
        waiting = f"ranks {', '.join(map(str, others))} wait" if len(others) > 1 else f"rank {others[0]} waits"
        assert f"behind: rank {stuck} (" in stalled and "in data of step 5" in stalled, stalled
        assert f"{waiting} for it" in stalled, stalled
        job = next(line.split()[0] for line in stalled.splitlines() if "local-" in line and "STALLED" in line)
        stacks = _status(job, "--stacks")
        assert f"== rank {stuck} ==" in stacks and "watchdog.py" in stacks and "in data" in stacks, stacks
        groups = {tuple(int(r) for r in h.split(" ", 1)[1].split(", ")): body for h, body in _stack_groups(stacks)}
        assert sorted(r for g in groups for r in g if r != stuck) == others, stacks
        assert all("torch" in body for g, body in groups.items() if stuck not in g), stacks
        # the flight recorders: the collective the stuck rank did not enter, and who waits in it (a group of the
        # mesh the stuck rank shares with the first waiting one)
        flight = [ln for ln in stacks.splitlines() if ln.startswith("flight recorder: ")]
        assert flight and f"rank {stuck} did not enter collective #" in flight[0], stacks  # the cause first
        assert any(ln.endswith(("wait in it", "waits in it")) for ln in flight), flight
        out, err = launch.communicate(timeout=240)
        print(err[-1500:])
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert launch.returncode != 0
    assert "llmctl: warning: STALLED" in err and err.count("llmctl: warning: STALLED") == 1
    assert "llmctl: warning: flight recorder: " in err and f"rank {stuck} did not enter collective #" in err, err
    assert "rank 0: a collective waited more than 25 s in " in err, err[-3000:]
    assert "Traceback" not in err.split("STALLED", 1)[1], err[-4000:]
    dumps = flight_dumps(tmp_path / "run")  # written by the ranks as the timeout ended them
    assert set(dumps) == set(range(nproc)) and all(d["recorders"]["gloo"]["entries"] for d in dumps.values())
    # every group's collectives wait the plan's 25 s, the mesh's sub-groups too (torch gives them 30 minutes)
    timeouts = {
        (e["process_group"][1], e["timeout_ms"]) for d in dumps.values() for e in d["recorders"]["gloo"]["entries"]
    }
    assert {t for _, t in timeouts} == {25_000}, timeouts
    assert nproc == 2 or {"mesh_tp", "mesh_shard"} <= {g for g, _ in timeouts}, timeouts
    marker = tmp_path / "run" / "ckpt" / "step_00000004" / "llmctl-checkpoint.json"
    assert marker.is_file() and json.loads(marker.read_text())
