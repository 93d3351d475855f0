"""The one error path (llmctl.errors.report): one line, the exit code, the structured record for a parent."""

from __future__ import annotations

import io

import pytest

from llmctl.errors import InputError, RuntimeFailure, describe, read_reports, report


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError (matched by name, so that the CLI never imports torch)."""


def test_describe_maps_each_kind() -> None:
    assert describe(InputError("bad", hint="fix it")) == ("bad (fix it)", 2)
    assert describe(RuntimeFailure("broke")) == ("broke", 1)
    assert describe(KeyboardInterrupt()) == ("interrupted", 130)
    msg, code = describe(OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore"))
    assert code == 1 and msg.startswith("out of memory: CUDA out of memory.") and "micro_batch_size" in msg
    msg, code = describe(ValueError("oops"))
    assert code == 1 and msg.startswith("internal error: ValueError: oops") and "LLMCTL_DEBUG=1" in msg


def test_report_prints_one_line_and_records(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("LLMCTL_DEBUG", raising=False)
    errors = tmp_path / "errors.jsonl"
    monkeypatch.setenv("LLMCTL_ERROR_FILE", str(errors))
    out = io.StringIO()
    assert report(InputError("no such plan"), rank=3, stream=out) == 2
    assert out.getvalue() == "llmctl: error: [rank 3] no such plan\n"
    assert report(InputError("no such plan"), rank=1, say=False, stream=out) == 2  # same message: one record
    assert report(RuntimeFailure("link down"), stream=out) == 1
    got = read_reports(errors)
    assert [(r.message, r.exit_code, r.kind, r.rank) for r in got] == [
        ("no such plan", 2, "InputError", 3),
        ("link down", 1, "RuntimeFailure", None),
    ]
    errors.write_text(errors.read_text() + '{"message": "cut sh')  # a crash mid-write is skipped
    assert len(read_reports(errors)) == 2


def test_debug_and_bugs_reraise(monkeypatch) -> None:
    monkeypatch.setenv("LLMCTL_DEBUG", "1")
    with pytest.raises(InputError):
        report(InputError("x"), stream=io.StringIO())
    monkeypatch.delenv("LLMCTL_DEBUG")
    with pytest.raises(ZeroDivisionError):
        report(ZeroDivisionError("bug"), reraise_bugs=True, stream=io.StringIO())
    assert report(OutOfMemoryError("oom"), reraise_bugs=True, stream=io.StringIO()) == 1


def test_debug_is_read_in_one_place() -> None:
    from pathlib import Path

    import llmctl

    root = Path(llmctl.__file__).parent
    readers = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if "LLMCTL_DEBUG" in p.read_text()]
    assert readers == ["errors.py"], readers


def test_error_lines_stay_one_line_whatever_the_user_typed() -> None:
    from llmctl.errors import InputError, describe, one_line

    assert one_line("plain ü 🙂") == "plain ü 🙂"
    assert one_line("a\nb\x1ec\u2028d\x00") == "a\\nb\\x1ec\\u2028d\\x00"
    message, code = describe(InputError("my\nplan.yaml: no such plan file"))
    assert (message, code) == ("my\\nplan.yaml: no such plan file", 2)
    assert describe(ValueError("embedded null byte")) == ("a path or value contains a NUL byte (\\x00)", 2)
