"""Issue 49: the data formats people have. Alpaca and ShareGPT chat records prepare as the equivalent `messages`
records do (same tokens, same loss mask), compressed inputs (.gz .bz2 .xz .zst) give the bytes of the plain file,
any text file is read with an explicit --glob, and each refusal is one line naming the file."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import numpy as np
import pytest
from data_helpers import run, stream
from test_instruction import read, write_jsonl


def _prepare(tmp_path: Path, name: str, *args: str) -> tuple[np.ndarray, np.ndarray]:
    out = tmp_path / name
    code, output = run("data", "prepare", *args, "--out", out)
    assert code == 0, output
    if "--instruction" in args:
        tokens, flags, _ = read(out)
        return tokens, flags
    return stream(out).astype(np.int64), np.zeros(0)


ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
]
ALPACA_AS_MESSAGES = [
    {"messages": [{"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "5"}]},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Sky colour?"},
            {"from": "gpt", "value": "Blue."},
            {"from": "human", "value": "Grass?"},
            {"from": "gpt", "value": "Green."},
        ]
    }
]
SHAREGPT_AS_MESSAGES = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Sky colour?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Grass?"},
            {"role": "assistant", "content": "Green."},
        ]
    }
]


@pytest.mark.parametrize(("rows", "same"), [(ALPACA, ALPACA_AS_MESSAGES), (SHAREGPT, SHAREGPT_AS_MESSAGES)])
def test_alpaca_and_sharegpt_prepare_as_their_messages(tmp_path: Path, rows: list, same: list) -> None:
    args = ("--instruction", "--seq-len", "256")
    got = _prepare(tmp_path, "got", str(write_jsonl(tmp_path / "in.jsonl", rows)), *args)
    want = _prepare(tmp_path, "want", str(write_jsonl(tmp_path / "want.jsonl", same)), *args)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert (got[1] & 1).sum() > 0  # some reply carries loss


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"conversations": [{"from": "robot", "value": "x"}]}, "conversations[0] is from 'robot'"),
        ({"conversations": [{"from": "gpt", "value": 3}]}, "conversations[0] has no string 'value'"),
        ({"conversations": []}, "'conversations' must be a non-empty list"),
        ({"instruction": "x", "output": 4}, "Alpaca record needs string 'instruction' and 'output'"),
        ({"text": "x"}, "no 'messages' or 'conversations' list, no 'instruction'"),
    ],
)
def test_bad_records_are_one_line_naming_the_line(tmp_path: Path, row: dict, message: str) -> None:
    src = write_jsonl(tmp_path / "bad.jsonl", [ALPACA[0], row])
    code, output = run("data", "prepare", src, "--out", tmp_path / "o", "--instruction", "--seq-len", "64")
    assert code == 2, output
    assert "bad.jsonl:2: " in output and message in output
    assert len(output.strip().splitlines()) <= 2 and "Traceback" not in output


def _zst(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress, ".zst": _zst}


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
def test_compressed_inputs_give_the_plain_files_tokens(tmp_path: Path, suffix: str) -> None:
    rows = "".join(json.dumps({"text": f"document {i} " * (i + 1)}) + "\n" for i in range(40)).encode()
    csv = b"id,text\n" + b"".join(f'{i},"row {i}, quoted"\n'.encode() for i in range(30))
    plain = tmp_path / "plain"
    packed = tmp_path / "packed"
    for d in (plain, packed):
        d.mkdir()
    (plain / "a.jsonl").write_bytes(rows)
    (plain / "b.csv").write_bytes(csv)
    (plain / "c.txt").write_bytes(b"a whole text file\n")
    for name, data in (("a.jsonl", rows), ("b.csv", csv), ("c.txt", b"a whole text file\n")):
        (packed / (name + suffix)).write_bytes(COMPRESS[suffix](data))
    want, _ = _prepare(tmp_path, "want", str(plain))
    got, _ = _prepare(tmp_path, "got", str(packed))  # the folder's compressed files are found and read
    assert len(want) > 1000 and np.array_equal(got, want)


def test_compressed_chat_records_prepare(tmp_path: Path) -> None:
    src = tmp_path / "chat.jsonl.gz"
    src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ALPACA).encode()))
    got = _prepare(tmp_path, "got", str(src), "--instruction", "--seq-len", "256")
    want = _prepare(
        tmp_path, "want", str(write_jsonl(tmp_path / "w.jsonl", ALPACA)), "--instruction", "--seq-len", "256"
    )
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_a_truncated_stream_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "cut.jsonl.gz"
    src.write_bytes(gzip.compress(b'{"text": "x"}\n' * 2000)[:60])
    code, output = run("data", "prepare", src, "--out", tmp_path / "o")
    assert code == 2, output
    assert "cut.jsonl.gz: cannot read (.gz stream:" in output and "Traceback" not in output


def test_a_compressed_parquet_is_refused_in_one_line(tmp_path: Path) -> None:
    src = tmp_path / "t.parquet.gz"
    src.write_bytes(gzip.compress(b"PAR1"))
    code, output = run("data", "prepare", src, "--out", tmp_path / "o")
    assert code == 2 and "t.parquet.gz: a compressed parquet file" in output, output


def test_any_text_file_by_an_explicit_glob(tmp_path: Path) -> None:
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("def f():\n    return 1\n")
    (src / "pkg" / "b.py").write_text("x = 2\n")
    (src / "pkg" / "data.bin").write_bytes(b"\x00\x01")  # neither known nor matched: skipped inside a folder
    code, output = run("data", "prepare", src / "pkg" / "a.py", "--out", tmp_path / "o1")
    assert code == 2 and "unknown kind of input '.py'" in output and "--glob '*.py'" in output, output
    got, _ = _prepare(tmp_path, "got", str(src), "--glob", "*.py")
    # the byte tokenizer: BOS, the file's bytes, EOS per document, files in sorted order
    want = [256, *b"def f():\n    return 1\n", 257, 256, *b"x = 2\n", 257]
    assert got.tolist() == want


def test_instruction_says_why_it_needs_the_sequence_length(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "c.jsonl", ALPACA)
    code, output = run("data", "prepare", src, "--out", tmp_path / "o", "--instruction")
    assert code == 2 and "packed whole into sequences of exactly that many tokens" in output, output
