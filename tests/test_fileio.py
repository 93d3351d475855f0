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
