"""The engine's resume on real runs (issue 46): a damaged newest checkpoint, a changed plan, --resume-anyway.

One plain process runs the plans one after the other (tests/engine/resume_runs.py; a world of one, no torchrun):
1. 4 steps, checkpoints at 2 and 4;
2. step 4's RNG file cut in half, the run lengthened to 6: resumes from step 2 with a `warning` event naming the
   file, step 4 set aside, and the steps it redoes have the first run's losses (the RNG and states restored
   from the plain-data files);
3. the same checkpoint under a plan with another lr: refused in one line naming optimizer.lr, exit 2;
4. the same with LLMCTL_RESUME_ANYWAY=1 (what `llmctl launch --resume-anyway` sets): resumes, a `resume` event
   names the change, and the new lr is the one used.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmctl.engine.optim import lr_factor
from tests.engine.conftest import REPO, engine_env, records, write_plan

RUNS = REPO / "tests" / "engine" / "resume_runs.py"
ONE_RANK = {"hardware": {"nproc_per_node": 1}, "checkpoint": {"interval_steps": 2, "keep_last": 5}}


def _plan(folder: Path, name: str, over: dict[str, Any]) -> Path:
    """A tiny one-rank plan named `name` in `folder` (all share folder/logs and folder/ckpt)."""
    return write_plan(folder, {**ONE_RANK, **over}, ckpt=True).rename(folder / name)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resume")
    folder = root / "run"
    first = _plan(folder, "first.yaml", {"training": {"max_steps": 4}})
    longer = _plan(folder, "longer.yaml", {"training": {"max_steps": 6}})
    other = _plan(folder, "other.yaml", {"training": {"max_steps": 8}, "optimizer": {"lr": 1e-3}})
    ckpt = folder / "ckpt"
    actions = [
        {"plan": str(first)},
        {"truncate": str(ckpt / "step_00000004" / "rng-rank0.pt")},
        {"plan": str(longer)},
        {"plan": str(other)},
        {"plan": str(other), "env": {"LLMCTL_RESUME_ANYWAY": "1"}},
    ]
    (root / "actions.json").write_text(json.dumps(actions))
    out = root / "results.json"
    proc = subprocess.run(
        [sys.executable, str(RUNS), str(out), str(root / "actions.json")],
        cwd=REPO,
        env=engine_env(root),
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = json.loads(out.read_text()) if out.exists() else []
    assert proc.returncode == 0 and len(results) == 4, (proc.stdout[-3000:], proc.stderr[-5000:], results)
    return {"plan": first, "ckpt": ckpt, "results": results}


def test_damaged_newest_resumes_from_the_previous_one(resumed: dict[str, Any]) -> None:
    """Fails on the old main: the truncated RNG file gave a traceback (torch.load's error), no warning event."""
    plan, ckpt, results = resumed["plan"], resumed["ckpt"], resumed["results"]
    assert results[0]["code"] == 0 and results[1]["code"] == 0, results
    warnings = records(plan, "warning")
    assert len(warnings) == 1 and str(ckpt / "step_00000004" / "rng-rank0.pt") in warnings[0]["message"]
    assert (ckpt / "step_00000004.damaged").is_dir()
    starts = records(plan, "start")
    assert [s["step"] for s in starts[:2]] == [0, 2]
    steps = records(plan, "step")
    first_run = {r["step"]: r["loss"] for r in steps[:4]}
    second_run = {r["step"]: r["loss"] for r in steps[4:8]}
    assert sorted(second_run) == [3, 4, 5, 6]
    assert second_run[3] == first_run[3] and second_run[4] == first_run[4]  # bit for bit after the restore


def test_changed_plan_is_refused_in_one_line(resumed: dict[str, Any]) -> None:
    """Fails on the old main: another lr resumed silently (only the global batch was compared)."""
    refused = resumed["results"][2]
    assert refused["code"] == 2 and len(refused["errors"]) == 1, refused
    assert "optimizer.lr: 0.003 -> 0.001" in refused["errors"][0] and "--resume-anyway" in refused["errors"][0]


def test_resume_anyway_logs_the_change_and_uses_the_new_lr(resumed: dict[str, Any]) -> None:
    """Fails on the old main: no `resume` event, and the checkpoint's param groups kept the old lr."""
    plan, anyway = resumed["plan"], resumed["results"][3]
    assert anyway["code"] == 0, anyway
    event = records(plan, "resume")
    assert len(event) == 1 and event[0]["step"] == 6 and event[0]["changes"] == ["optimizer.lr: 0.003 -> 0.001"]
    lr7 = next(r["lr"] for r in reversed(records(plan, "step")) if r["step"] == 7)
    assert lr7 == pytest.approx(1e-3 * lr_factor(6, 8, 3, 0.1))


def test_launch_resume_anyway_sets_the_engine_variable(tmp_path: Path) -> None:
    """`llmctl launch --resume-anyway` hands LLMCTL_RESUME_ANYWAY=1 to the ranks (what the runs above set); without
    it the command line has no such variable."""
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    plan = _plan(tmp_path, "p.yaml", {"training": {"max_steps": 4}})
    with_flag = CliRunner().invoke(app, ["launch", str(plan), "--resume-anyway", "--dry-run"])
    without = CliRunner().invoke(app, ["launch", str(plan), "--dry-run"])
    assert with_flag.exit_code == 0 and without.exit_code == 0, (with_flag.output, without.output)
    assert "LLMCTL_RESUME_ANYWAY=1 " in with_flag.output and "LLMCTL_RESUME_ANYWAY" not in without.output
