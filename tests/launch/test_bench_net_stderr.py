"""`llmctl bench-net`'s filter of the workers' stderr (llmctl.launch.bench_net._filter_stderr), line by line without
torchrun: what reaches the terminal (the progress bar), what only the log keeps (the workers' error lines, which the
error file turns into one line, and torchrun's own failure report from its first line to the end)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from llmctl.launch.bench_net import _filter_stderr

LINES = [
    b"all_reduce 1 MiB ... 50%\n",
    b"llmctl: error: rank 1: the all-reduce timed out\n",
    b"[W1129 10:00:00.000000 socket.cpp:100] hostname of the client socket cannot be retrieved\n",
    b"all_reduce 1 MiB ... 100%\n",
    b"Traceback (most recent call last):\n",
    b'  File "/venv/bin/torchrun", line 8, in <module>\n',
    b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n",
]


def test_the_terminal_gets_the_progress_and_the_log_gets_everything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "torchrun.log"
    _filter_stderr(io.BytesIO(b"".join(LINES)), log)
    # torchrun's report stays out from its first line on (not only the line that matched)
    assert capsys.readouterr().err == "all_reduce 1 MiB ... 50%\nall_reduce 1 MiB ... 100%\n"
    assert log.read_bytes() == b"".join(LINES)
