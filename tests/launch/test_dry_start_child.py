"""`llmctl launch --dry-start` from the launch side (llmctl.launch.dry_start), without running the engine: the child's
command line as it is built, and the plan copy that --tp/--cp/... size. The engine's half (what the dry start
measures) is tests/engine/test_dry_start.py's, minutes; these take a second."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import minimal_plan_yaml

from llmctl.launch import dry_start as ds
from llmctl.spec.planfile import load_plan


def test_the_childs_command_line_keeps_each_option_with_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []

    def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        next(Path(a) for a in argv if a.endswith("report.json")).write_text('{"world_size": 2}')
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(ds.subprocess, "run", run)
    plan = tmp_path / "plan.yaml"
    for allocate_all in (False, True):
        assert ds.dry_start(plan, allocate_all=allocate_all) == {"world_size": 2}
    plain, allocating = seen
    assert plain[:4] == [sys.executable, "-m", "llmctl.engine", "--dry-start"]
    assert plain[4] == "--json-out" and plain[5].endswith("report.json") and plain[6:] == [str(plan)]
    # --allocate-all goes among the flags, never between --json-out and its path
    assert allocating == plain[:4] + ["--allocate-all"] + [allocating[5], allocating[6], str(plan)]
    assert allocating[5] == "--json-out" and allocating[6].endswith("report.json")


def test_an_override_sizes_a_copy_and_leaves_the_plan_file_alone(tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text(minimal_plan_yaml(nodes=1, nproc=2))
    before = plan.read_text()
    copy = ds._at(plan, {"tp": 2}, tmp_path / "dry")
    assert copy == tmp_path / "dry" / "plan.yaml" and plan.read_text() == before
    assert load_plan(copy).setup.tp == 2 and load_plan(plan).setup.tp == 1
