"""write_atomic: all or nothing, and the permissions of an ordinary new file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from llmctl.fileio import write_atomic


def test_new_file_has_the_umask_permissions(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "plan.yaml", "a: 1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plan.yaml").stat().st_mode) == 0o640  # not mkstemp's 0600
    write_atomic(tmp_path / "job.sbatch", "#!/bin/bash\n", mode=0o755)
    assert stat.S_IMODE((tmp_path / "job.sbatch").stat().st_mode) == 0o755


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "plan.yaml"
    target.write_text("old\n")

    class Boom(str):
        def encode(self, *a: object) -> bytes:  # fails while the temporary file is being written
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, Boom("new\n"))
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]


# ---------------------------------------------------------------------------------------------- reading inputs

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b]\n"
CASES = {
    "missing": (None, "no such"),
    "folder": ("<dir>", "is a folder"),
    "empty": ("", "empty"),
    "blank": ("  \n\n", "empty"),
    "binary": (b"\xff\xfe\x00garbage", "not a UTF-8 text file"),
    "huge": ("<huge>", "larger than 64 MiB"),
    "bad yaml": ("a: [\n", "not valid YAML line"),
    "duplicate key": ("nodes: 1\nnodes: 2\n", "duplicate key 'nodes'"),
    "alias bomb": (BOMB, "aliases (*name) are not allowed"),
}


def make_input(tmp_path: Path, content: object, name: str) -> Path:
    p = tmp_path / name
    if content == "<dir>":
        p.mkdir()
    elif content == "<huge>":
        with p.open("wb") as f:  # sparse: nothing is written, the size is what counts
            f.truncate(64 * 2**20 + 10)
    elif isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    return p


COMMANDS = {
    "cluster": ["plan", "llama-2-7b", "--no-write", "--cluster", "{path}"],
    "plan-file": ["launch", "{path}", "--dry-run"],
    "config.json": ["estimate-memory", "{path}"],
    "bench": ["plan", "llama-2-7b", "--gpu", "A100-80GB", "--no-write", "--net", "{path}"],
    "metrics": ["plan", "llama-2-7b", "--gpu", "A100-80GB", "--no-write", "--calibrate", "{path}"],
}
YAML_INPUTS = ("cluster", "plan-file")
YAML_ONLY = ("bad yaml", "duplicate key", "alias bomb")
PARAMS = [
    pytest.param(COMMANDS[c], *CASES[k], id=f"{c}-{k}")
    for c in COMMANDS
    for k in CASES
    if c in YAML_INPUTS or k not in YAML_ONLY
] + [
    pytest.param(COMMANDS[c], "{not json", "not valid JSON", id=f"{c}-bad json")
    for c in COMMANDS
    if c not in YAML_INPUTS
]


@pytest.mark.parametrize(("command", "content", "message"), PARAMS)
def test_every_file_input_problem_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], content: object, message: str
) -> None:
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    monkeypatch.chdir(tmp_path)
    name = "config.json" if command[0] == "estimate-memory" else "input.yaml"
    path = make_input(tmp_path, content, name)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(app, [a.replace("{path}", str(path)) for a in command])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    if not (command[0] == "estimate-memory" and content == "<dir>"):  # a folder is read as folder/config.json
        assert message in lines[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
