"""`llmctl data prepare` stops its helper processes when it is signalled (issue 46): SIGTERM, SIGHUP or SIGINT to the
command alone (`kill PID`, a job wrapper, a closed terminal) ends it in one line with 128 + the signal, and its
forkserver, resource tracker and tokenizer workers end with it; SIGKILL (which the command cannot handle) leaves
them noticing their parent's death. Before, each stayed (~50 MB each) with parent pid 1.

tests/data/test_atomic.py signals the whole process group (what a terminal's Ctrl-C does); these signal the command's
pid only, which is what leaves orphans."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_helpers import make_docs, write_docs

REPO = Path(__file__).resolve().parents[2]


def sigint_default() -> None:
    """SIGINT as a terminal leaves it: a shell's background job (`make test &` in a script) starts with SIGINT
    ignored, which Python then keeps ignoring, so the Ctrl-C case would test the launcher's shell, not llmctl."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def session_processes(sid: int) -> list[str]:
    """The processes of session `sid` (the command started its own: its forkserver, resource tracker and workers
    stay in it even when their parent dies), as 'pid command' lines."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6: the session id; zombies are already dead
            out.append(f"{p.name} {cmd[:120]}")
    return out


def wait_gone(sid: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signalled_prepare_leaves_no_process(tmp_path: Path, hf_tokenizer: str, sig: signal.Signals) -> None:
    src = write_docs(tmp_path / "in.jsonl", make_docs(6000, seed=5, words=(50, 150)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "llmctl", "data", "prepare", str(src), "--out", str(out), "--workers", "2"]
    cmd += ["--tokenizer", hf_tokenizer, "--shard-tokens", "20000"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the forkserver's socket folder
    proc = subprocess.Popen(
        cmd, cwd=REPO, start_new_session=True, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_default
    )
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.tmp-*/train-00001.bin")):  # mid-run: one shard complete, more to come
            assert proc.poll() is None, f"finished before it could be signalled: {proc.stderr.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.02)
        helpers = [p for p in session_processes(proc.pid) if not p.startswith(f"{proc.pid} ")]
        assert len(helpers) >= 4, helpers  # a forkserver, a resource tracker and two workers
        proc.send_signal(sig)  # to the command alone
        _, stderr = proc.communicate(timeout=60)
        left = wait_gone(proc.pid, 30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the test found left
    assert left == [], left
    assert not out.exists()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        return
    assert proc.returncode == 128 + sig, stderr
    said = "interrupted" if sig == signal.SIGINT else f"interrupted ({sig.name})"
    assert stderr.strip() == f"llmctl: error: {said}", stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # its temporary folder removed
