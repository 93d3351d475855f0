"""The test harness's own rule for torchrun launches (tests/engine/conftest.py): a launch whose rank died of glibc's
heap-corruption abort runs once more, with a warning; any other failure, or the same abort again, is returned as is."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.engine import conftest


def _fake(monkeypatch: pytest.MonkeyPatch, outcomes: list[tuple[int, str]]) -> list[int]:
    calls: list[int] = []

    def run(cmd, **kw):  # noqa: ANN001, ANN003
        code, err = outcomes[len(calls)]
        calls.append(code)
        return subprocess.CompletedProcess(cmd, code, "", err)

    monkeypatch.setattr(conftest.subprocess, "run", run)
    return calls


ABORT = "W1127 x\nmalloc(): unaligned tcache chunk detected\nE1127 failed (exitcode: -6)\n"


def test_a_heap_abort_runs_once_more_with_a_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _fake(monkeypatch, [(1, ABORT), (0, "")])
    with pytest.warns(UserWarning, match=r"a rank aborted \(malloc\(\): unaligned tcache chunk detected\)"):
        proc = conftest.torchrun_script(Path("w.py"), [], 4, tmp_path)
    assert proc.returncode == 0 and calls == [1, 0]


def test_the_same_abort_twice_fails_and_other_failures_are_not_rerun(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _fake(monkeypatch, [(1, ABORT), (1, ABORT)])
    with pytest.warns(UserWarning):
        assert conftest.torchrun_script(Path("w.py"), [], 4, tmp_path).returncode == 1
    assert calls == [1, 1]
    calls = _fake(monkeypatch, [(1, "AssertionError: losses differ\nmalloc is fine here\n")])
    assert conftest.torchrun_script(Path("w.py"), [], 4, tmp_path).returncode == 1 and calls == [1]
