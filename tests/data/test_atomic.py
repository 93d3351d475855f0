"""An interrupted or failed prepare leaves nothing that looks complete and never loses the previous output; memory
stays flat as the corpus grows (streaming)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import make_docs, run, stream, write_docs

from llmctl.data import output
from llmctl.data import prepare as prep

REPO = Path(__file__).resolve().parents[2]


def sigint_default() -> None:
    """SIGINT as a terminal leaves it: a shell's background job (`make test &` in a script) starts with SIGINT
    ignored, which Python then keeps ignoring, so the Ctrl-C case would test the launcher's shell, not llmctl."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("where", ["writer", "meta", "rename"])
def test_a_failure_leaves_no_output_and_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    src = write_docs(tmp_path / "in.jsonl", make_docs(300, seed=4))
    monkeypatch.setattr(prep, "BATCH_DOCS", 10)
    assert run("data", "prepare", src, "--out", tmp_path / "old")[0] == 0
    old = _snapshot(tmp_path / "old")

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    if where == "writer":  # mid-stream, after some shards are written
        real_write, calls = output.ShardWriter.write, []

        def write(self: output.ShardWriter, tokens: np.ndarray) -> None:
            calls.append(1)
            if len(calls) > 8:
                boom()
            real_write(self, tokens)

        monkeypatch.setattr(output.ShardWriter, "write", write)
    elif where == "meta":
        monkeypatch.setattr(output, "write_meta", boom)
    else:  # the old output is moved aside, then the new one cannot take its place
        real_rename = os.rename
        monkeypatch.setattr(
            output.os, "rename", lambda a, b: boom() if ".tmp-" in str(a) else real_rename(a, b), raising=True
        )
    for out, force in ((tmp_path / "new", []), (tmp_path / "old", ["--force"])):
        code, said = run("data", "prepare", src, "--out", out, "--shard-tokens", "500", *force)
        assert code == 1 and said.strip().endswith("No space left on device"), said
        assert len(said.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()
    assert _snapshot(tmp_path / "old") == old  # --force replaces only once the new one is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "old"]  # no temporary folder left


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_killed_prepare_leaves_nothing_complete_and_the_next_run_cleans_up(
    tmp_path: Path, hf_tokenizer: str, sig: signal.Signals
) -> None:
    """Mid-way, SIGKILL (the OOM killer, a preempted job) leaves no --out, only a hidden temporary folder, which the
    next prepare of the same --out removes; Ctrl-C (SIGINT to the whole process group) ends in one line, exit 130,
    nothing left."""
    src = write_docs(tmp_path / "in.jsonl", make_docs(6000, seed=5, words=(50, 150)))
    out = tmp_path / "o[u]t *"  # a name that a glob would misread
    cmd = [sys.executable, "-m", "llmctl", "data", "prepare", str(src), "--out", str(out), "--workers", "1"]
    cmd += ["--tokenizer", hf_tokenizer, "--shard-tokens", "20000"]
    # Its forkserver's socket folder goes to TMPDIR; a SIGKILL leaves it behind: keep it under pytest's own folder.
    env = {**os.environ, "TMPDIR": str(tmp_path.parent / f"{tmp_path.name}-tmpdir")}
    os.makedirs(env["TMPDIR"], exist_ok=True)
    proc = subprocess.Popen(
        cmd, cwd=REPO, start_new_session=True, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_default
    )
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".o?u?t ?.tmp-*/train-00001.bin")):  # one shard complete, more to come
            assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, sig)  # the command, its forkserver and workers
        _, stderr = proc.communicate(timeout=60)
    assert not out.exists()
    temps = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and stderr.strip() == "llmctl: error: interrupted", stderr
        assert temps == []
        return
    (temp,) = temps
    assert temp.name.startswith(f".{out.name}.tmp-") and not (temp / "meta.json").exists()
    code, said = run("data", "prepare", src, "--out", out, "--tokenizer", hf_tokenizer)
    assert code == 0, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", out.name]  # the dead run's folder is gone
    assert len(stream(out)) == json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens"]


# VmHWM, not getrusage's ru_maxrss: Linux copies ru_maxrss from the parent at fork (here: pytest's, with
# transformers loaded), while VmHWM belongs to this process's own memory since its exec.
PEAK_RSS = """
import re, sys
from llmctl.data.prepare import PrepareConfig, prepare
prepare(PrepareConfig(inputs=(sys.argv[1],), out=sys.argv[2], workers=1, val_fraction=0.1))
print(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
"""


def test_memory_does_not_grow_with_the_corpus(tmp_path: Path) -> None:
    """Peak RSS of the reading and writing process for a corpus of N and of 10N (2 MB and 20 MB): holding the
    corpus, or its tokens, would add tens of MB."""
    doc = json.dumps({"text": "streaming " * 200}) + "\n"  # 2 KB per document
    peaks = {}
    for n in (1000, 10_000):
        src = tmp_path / f"c{n}.jsonl"
        src.write_text(doc * n)
        r = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, str(src), str(tmp_path / f"out{n}")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        peaks[n] = int(r.stdout.split()[-1]) / 1024  # MiB
        assert json.loads((tmp_path / f"out{n}" / "meta.json").read_text())["splits"]["train"]["documents"] == n * 0.9
    assert peaks[10_000] - peaks[1000] < 8, peaks


def test_only_temporary_folders_of_dead_processes_on_this_host_are_removed(tmp_path: Path) -> None:
    import socket

    host = socket.gethostname()
    names = [f".out.tmp-{host}-{os.getppid()}", f".out.tmp-{host}-4999999", ".out.tmp-other-host-4999999", ".keep"]
    for name in names:
        (tmp_path / name).mkdir()
    removed = output.remove_stale_temps(tmp_path / "out")
    assert [p.name for p in removed] == [f".out.tmp-{host}-4999999"]  # a live prepare, another host's: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {f".out.tmp-{host}-4999999"})
