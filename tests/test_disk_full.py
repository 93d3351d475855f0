"""A full disk or quota is the user's to fix, not a bug (issue 46): one line naming the path, exit 1, and the
previous file as it was. Before, `plan -o` on a full disk said "internal error: OSError: [Errno 28] No space left on
device (a bug in llmctl: ...)" (this test failed on main then). Checked by hand on a 64 KiB tmpfs too:
`llmctl: error: /tmp/tiny/plan.yaml: no space left on device (free some space, or write it elsewhere)`, exit 1,
the old plan.yaml unchanged.

The disk fills in fsync here, the last write before the rename (an NFS server reports ENOSPC there); a real full
disk fails the flush before it, which write_atomic handles the same way."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import describe


class SafetensorError(Exception):
    """Stands in for safetensors' Rust error, which carries the OS error in its text only."""


@pytest.mark.parametrize(
    "error, line",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/runs/x/plan.yaml"),
            "/runs/x/plan.yaml: no space left on device (free some space, or write it elsewhere)",
        ),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded (free some space, or write it elsewhere)"),
        (
            SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
            "no space left on device (free some space, or write it elsewhere)",
        ),
    ],
)
def test_a_full_disk_is_one_line_exit_1(error: BaseException, line: str) -> None:
    assert describe(error) == (line, 1)


def test_other_os_errors_stay_what_they_were() -> None:
    message, code = describe(OSError(errno.EIO, "Input/output error"))
    assert code == 1 and message.startswith("internal error: OSError: [Errno 5] Input/output error")


def test_plan_o_on_a_full_disk_names_the_file_and_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMCTL_DEBUG", raising=False)
    old = tmp_path / "plan.yaml"
    old.write_text("the previous plan\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    result = CliRunner().invoke(
        app, ["plan", "llama-3.2-1b", "--gpu", "h100", "--gpus", "8", "-o", str(old), "--force"]
    )
    assert result.exit_code == 1, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("llmctl: error: ")]
    assert len(errors) == 1 and f"no space left on the device writing {old}: it needs " in errors[0], errors
    assert "bytes" in errors[0] and "the previous file, if any, is intact" in errors[0], errors
    assert result.output.strip().splitlines()[-1] == errors[0] and "Traceback" not in result.output
    assert old.read_text() == "the previous plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]  # no temporary file left beside it
