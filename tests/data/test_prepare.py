"""`llmctl data prepare` end to end: every input kind gives the engine's token stream, any --workers the same bytes,
the validation split takes exactly floor(nF) evenly spread documents, shards cut the stream where told."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_helpers import expected_splits, is_val, make_docs, run, stream, write_docs
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.data import prepare as prep
from llmctl.data.format import open_prepared
from llmctl.data.tokenizer import load_tokenizer
from llmctl.engine.data import expand_paths, iter_documents, tokenize

DOCS = make_docs(120, seed=1)


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
@pytest.mark.parametrize("kind", [".jsonl", "", ".csv", ".parquet", ".dataset", ".datasetdict"])
def test_every_kind_gives_the_engine_token_stream(tmp_path: Path, kind: str, tokenizer: str, hf_tokenizer: str) -> None:
    tok = None if tokenizer == "bytes" else hf_tokenizer
    src = write_docs(tmp_path / f"in{kind}", DOCS)
    args = ["data", "prepare", src, "--out", tmp_path / "out", "--val-fraction", "0.25", "--workers", "2"]
    code, output = run(*args, *(["--tokenizer", tok] if tok else []))
    assert code == 0, output
    train, val = expected_splits(DOCS, tok, 0.25)
    assert np.array_equal(stream(tmp_path / "out"), train) and np.array_equal(stream(tmp_path / "out", "val"), val)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["splits"]["train"]["documents"] == 90 and meta["splits"]["val"]["documents"] == 30
    assert meta["tokenizer"]["fingerprint"] == load_tokenizer(tok).fingerprint()
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == load_tokenizer(tok).vocab_size
    if kind in (".jsonl", ""):  # the engine's own reader of the same files: the same stream, train and val together
        files = expand_paths([str(src)])
        whole = tokenize(iter_documents(files), load_tokenizer(tok))
        code, output = run("data", "prepare", src, "--out", tmp_path / "all", *(["--tokenizer", tok] if tok else []))
        assert code == 0 and np.array_equal(stream(tmp_path / "all"), whole), output
    assert "prepared" in output and "120 documents" in output


def test_inputs_mix_in_the_order_given_and_folders_sort(tmp_path: Path) -> None:
    a, b = DOCS[:50], DOCS[50:]
    folder = write_docs(tmp_path / "corpus", a)
    (folder / "notes.docx").write_text("skipped: not a known kind inside a folder")
    (folder / ".hidden.txt").write_text("skipped: hidden")
    jl = write_docs(tmp_path / "more.jsonl", b)
    code, output = run("data", "prepare", jl, folder, "--out", tmp_path / "out")
    assert code == 0, output
    assert np.array_equal(stream(tmp_path / "out"), expected_splits(b + a, None, 0)[0])
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["sources"][0] == str(jl) and meta["sources"][1:] == [
        str(folder / f"doc-{i:05d}.txt") for i in range(50)
    ]


def test_any_workers_and_batch_size_give_identical_bytes(
    tmp_path: Path, hf_tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = make_docs(400, seed=2)
    src = [write_docs(tmp_path / "a.jsonl", docs[:300]), write_docs(tmp_path / "b.parquet", docs[300:])]
    outs = {}
    for workers, batch_docs in ((1, 1024), (2, 7), (2, 1024), (3, 50)):
        monkeypatch.setattr(prep, "BATCH_DOCS", batch_docs)  # many batches in flight, out of order in the pool
        out = tmp_path / f"out-{workers}-{batch_docs}"
        args = ["--val-fraction", "0.1", "--shard-tokens", "5000", "--tokenizer", hf_tokenizer]
        code, output = run("data", "prepare", *src, "--out", out, "--workers", str(workers), *args)
        assert code == 0, output
        outs[out] = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "meta.json"}
        meta = json.loads((out / "meta.json").read_text())
        meta.pop("seconds")
        outs[out]["meta"] = meta
    first, *rest = outs.values()
    assert len(first) > 3  # several shards
    assert all(o == first for o in rest)


@pytest.mark.parametrize(
    ("n", "fraction", "val_docs"),
    [(10, 0.1, 1), (100, 0.01, 1), (30, 0.1, 3), (7, 0.5, 3), (1000, 0.05, 50), (3, 0.7, 2), (5, 0.999, 4)],
)
def test_val_split_takes_floor_n_f_documents(tmp_path: Path, n: int, fraction: float, val_docs: int) -> None:
    assert sum(prep.is_val(i, *prep.val_ratio(fraction)) for i in range(n)) == val_docs
    src = write_docs(tmp_path / "in.jsonl", [f"document {i}" for i in range(n)])
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--val-fraction", str(fraction))
    assert code == 0, output
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["splits"]["val"]["documents"] == val_docs and meta["splits"]["train"]["documents"] == n - val_docs
    val_text = bytes(t for t in stream(tmp_path / "out", "val").tolist() if t < 256).decode()
    assert val_text == "".join(f"document {i}" for i in range(n) if is_val(i, fraction))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 3000), fraction=st.floats(0, 0.999, allow_subnormal=False))
def test_val_split_is_exact_and_evenly_spread(n: int, fraction: float) -> None:
    from fractions import Fraction

    p, q = prep.val_ratio(fraction)
    assert Fraction(p, q) == Fraction(repr(fraction))
    seen = 0
    for i in range(n):
        seen += prep.is_val(i, p, q)
        assert seen == (i + 1) * p // q  # after any prefix of k documents: exactly floor(kF), never bunched


def test_shards_hold_at_most_shard_tokens_and_read_back_across_boundaries(tmp_path: Path) -> None:
    src = write_docs(tmp_path / "in.jsonl", DOCS)
    code, output = run(
        "data", "prepare", src, "--out", tmp_path / "out", "--shard-tokens", "97", "--val-fraction", "0.2"
    )
    assert code == 0, output
    whole_train, whole_val = expected_splits(DOCS, None, 0.2)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    for split, whole in (("train", whole_train), ("val", whole_val)):
        shards = meta["splits"][split]["shards"]
        assert [s["file"] for s in shards] == [f"{split}-{k:05d}.bin" for k in range(len(shards))]
        assert all(s["tokens"] == 97 for s in shards[:-1]) and 0 < shards[-1]["tokens"] <= 97
        assert sum(s["tokens"] for s in shards) == meta["splits"][split]["tokens"] == whole.size
        files = b"".join((tmp_path / "out" / s["file"]).read_bytes() for s in shards)
        assert files == whole.astype("<u2").tobytes()  # raw little-endian uint16, in order
        tokens, _ = open_prepared(tmp_path / "out", split)
        rng = np.random.default_rng(0)
        for _ in range(300):
            a, b = sorted(rng.integers(0, whole.size + 1, 2))
            assert np.array_equal(tokens[a:b], whole[a:b])
        assert np.array_equal(tokens[90:300], whole[90:300]) and tokens[96] == whole[96] and tokens[97] == whole[97]
    assert "shards" in output and "val" in output


def test_seq_len_is_recorded_and_checked(tmp_path: Path) -> None:
    src = write_docs(tmp_path / "in.jsonl", ["x" * 50, "y" * 50])  # 52 tokens each with BOS and EOS
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--seq-len", "103")
    assert code == 0 and json.loads((tmp_path / "out" / "meta.json").read_text())["seq_len"] == 103, output
    code, output = run("data", "prepare", src, "--out", tmp_path / "out2", "--seq-len", "104")
    assert code == 2 and "the train split has 104 tokens, less than one block of --seq-len 104" in output
    write_docs(tmp_path / "in3.jsonl", ["x" * 50, "y" * 50, "z" * 50])  # the third document is the val split
    args = ["--seq-len", "52", "--val-fraction", "0.4"]
    code, output = run("data", "prepare", tmp_path / "in3.jsonl", "--out", tmp_path / "out3", *args)
    assert code == 2 and "the val split has 52 tokens, less than one block of --seq-len 52" in output
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


def test_prepare_api_reports_progress(tmp_path: Path) -> None:
    src = write_docs(tmp_path / "in.parquet", DOCS)
    seen: list[prep.Progress] = []
    cfg = prep.PrepareConfig(inputs=(str(src),), out=tmp_path / "out", workers=1)
    result = prep.prepare(cfg, seen.append)
    assert result.documents == 120 and result.tokens == seen[-1].tokens == len(stream(tmp_path / "out"))
    assert seen[-1].total_documents == 120 and seen[-1].documents == 120  # parquet knows its row count
    assert result.splits["val"].shards == 0 and result.meta["splits"]["val"] == {
        "documents": 0,
        "tokens": 0,
        "shards": [],
    }
