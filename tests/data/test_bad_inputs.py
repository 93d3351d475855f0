"""Every bad input of `llmctl data prepare` is one line on stderr and exit 2, and nothing is written."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from data_helpers import make_docs, run, write_docs

GOOD = make_docs(20, seed=3)


def jsonl(text: str) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        (d / "in.jsonl").write_text(text)
        return [str(d / "in.jsonl")]

    return make


def files(*names: str) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        for n in names:
            write_docs(d / n, GOOD)
        return [str(d / names[0])]

    return make


def parquet_with(**columns: list[object]) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), d / "in.parquet")
        return [str(d / "in.parquet")]

    return make


def raw(name: str, data: bytes) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        (d / name).write_bytes(data)
        return [str(d / name)]

    return make


def empty_folder(d: Path) -> list[str]:
    (d / "corpus").mkdir()
    (d / "corpus" / "readme.docx").write_text("not a known kind")
    return [str(d / "corpus")]


def dataset_dict_without_train(d: Path) -> list[str]:
    import datasets

    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(d / "dd"))
    return [str(d / "dd")]


def dataset_with_int_column(d: Path) -> list[str]:
    import datasets

    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(d / "ds"))
    return [str(d / "ds")]


CASES = [
    ("missing-file", lambda d: [str(d / "nope.jsonl")], [], "nope.jsonl: no such file or folder"),
    ("unknown-suffix", raw("book.docx", b"x"), [], "book.docx: unknown kind of input '.docx'"),
    ("jsonl-not-json", jsonl('{"text": "a"}\n{"text": \n'), [], "in.jsonl:2: not valid JSON"),
    ("jsonl-no-field", jsonl('{"text": "a"}\n\n{"body": "b"}\n'), [], "in.jsonl:3: no string field 'text'"),
    ("jsonl-not-object", jsonl('{"text": "a"}\n["text"]\n'), [], "in.jsonl:2: no string field 'text'"),
    ("jsonl-not-utf8", raw("in.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n'), [], "in.jsonl:2: not UTF-8"),
    ("jsonl-field-option", files("in.jsonl"), ["--text-field", "body"], "in.jsonl:1: no string field 'body'"),
    ("csv-no-column", files("in.csv"), ["--text-field", "body"], "in.csv: no column 'body' in the header (id, text)"),
    ("csv-empty", raw("in.csv", b""), [], "in.csv: empty CSV file"),
    ("parquet-no-column", parquet_with(body=["a"]), [], "in.parquet: no column 'text' (columns: body)"),
    ("parquet-not-text", parquet_with(text=[1, 2]), [], "in.parquet: column 'text' holds int64, not text"),
    ("parquet-null", parquet_with(text=["a", None]), [], "in.parquet: row 1 (0-based) has no 'text' (null)"),
    ("parquet-garbage", raw("in.parquet", b"not parquet at all"), [], "in.parquet: not a readable parquet file"),
    (
        "dataset-dict-no-train",
        dataset_dict_without_train,
        [],
        "a DatasetDict without a 'train' split (splits: validation)",
    ),
    ("dataset-int-column", dataset_with_int_column, [], "column 'text' holds int64, not text"),
    ("empty-corpus", jsonl("\n\n"), [], "no documents in"),
    ("empty-folder", empty_folder, [], "corpus: no documents found in this folder"),
    ("val-fraction-1", files("in.jsonl"), ["--val-fraction", "1"], "--val-fraction must be in [0, 1), got 1.0"),
    ("val-fraction-neg", files("in.jsonl"), ["--val-fraction", "-0.1"], "--val-fraction must be in [0, 1)"),
    (
        "val-too-few-docs",
        files("in.jsonl"),
        ["--val-fraction", "0.01"],
        "gives no validation document (it takes at least 100",
    ),
    ("workers-0", files("in.jsonl"), ["--workers", "0"], "--workers must be between 1 and 1024, got 0"),
    ("workers-huge", files("in.jsonl"), ["--workers", "1e30"], "--workers"),
    ("workers-nan", files("in.jsonl"), ["--workers", "nan"], "--workers"),
    ("shard-tokens-0", files("in.jsonl"), ["--shard-tokens", "0"], "--shard-tokens must be a positive integer"),
    ("seq-len-0", files("in.jsonl"), ["--seq-len", "0"], "--seq-len must be a positive integer"),
    ("seq-len-huge", files("in.jsonl"), ["--seq-len", "99999999999"], "--seq-len"),
    ("val-fraction-nan", files("in.jsonl"), ["--val-fraction", "nan"], "--val-fraction"),
    (
        "tokenizer-missing",
        files("in.jsonl"),
        ["--tokenizer", "/no/such/tok"],
        "--tokenizer: '/no/such/tok' is not a folder",
    ),
    ("empty-text-field", files("in.jsonl"), ["--text-field", ""], "--text-field must not be empty"),
]


@pytest.mark.parametrize(("make", "extra", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, make, extra, message: str) -> None:  # type: ignore[no-untyped-def]
    inputs = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    code, output = run("data", "prepare", *inputs, "--out", tmp_path / "out", *extra)
    lines = output.strip().splitlines()
    assert code == 2, output
    assert len(lines) == 1 and lines[0].startswith("llmctl: error: "), output
    assert message in lines[0] and "internal error" not in lines[0], lines[0]
    assert sorted(tmp_path.rglob("*")) == before  # no output, no temporary folder left


def test_a_tokenizer_folder_that_does_not_load(tmp_path: Path) -> None:
    write_docs(tmp_path / "in.jsonl", GOOD)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{broken")
    code, output = run(
        "data", "prepare", tmp_path / "in.jsonl", "--out", tmp_path / "out", "--tokenizer", tmp_path / "tok"
    )
    assert code == 2 and len(output.strip().splitlines()) == 1, output
    assert output.startswith(f"llmctl: error: --tokenizer: cannot load a tokenizer from '{tmp_path / 'tok'}'"), output
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("module", "kind"), [("pyarrow.parquet", ".parquet"), ("datasets", ".dataset")])
def test_a_missing_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, kind: str) -> None:
    src = write_docs(tmp_path / f"in{kind}", GOOD)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError, as when not installed
    code, output = run("data", "prepare", src, "--out", tmp_path / "out")
    assert code == 2 and len(output.strip().splitlines()) == 1, output
    assert f"needs the optional package '{module}' (pip install 'llmctl[data]')" in output


def test_an_existing_out_is_refused_without_force_and_only_a_prepared_one_replaced(tmp_path: Path) -> None:
    src = write_docs(tmp_path / "in.jsonl", GOOD)
    assert run("data", "prepare", src, "--out", tmp_path / "out")[0] == 0
    meta = (tmp_path / "out" / "meta.json").read_text()
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--val-fraction", "0.5")
    assert code == 2 and output.strip() == (
        f"llmctl: error: {tmp_path / 'out'} already exists (use --force to replace it once the new dataset is complete)"
    )
    assert (tmp_path / "out" / "meta.json").read_text() == meta
    mine = tmp_path / "my-thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    code, output = run("data", "prepare", src, "--out", mine, "--force")
    assert code == 2 and "exists and is not a prepared dataset: --force only replaces one" in output
    assert (mine / "chapter1.tex").read_text() == "years of work"
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--val-fraction", "0.5", "--force")
    assert code == 0 and json.loads((tmp_path / "out" / "meta.json").read_text())["val_fraction"] == 0.5, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "my-thesis", "out"]
