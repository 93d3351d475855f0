"""Helpers of the `llmctl data prepare` tests: generated documents in every input format, the command run in this
process, the prepared streams read back, the expected streams by the engine's own tokenize."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.data.format import open_prepared

WORDS = [
    "the",
    "of",
    "a",
    "tensor",
    "shard",
    "rank",
    "gradient",
    "数据",
    "naïve",
    "café",
    "token",
    "∑",
    "λ",
    "—",
    "\t",
    "tab",
]


def make_docs(n: int, seed: int = 0, words: tuple[int, int] = (0, 60)) -> list[str]:
    """n documents of random words, with line breaks, non-ASCII text and (for n > 3) one empty document."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = rng.randint(*words)
        text = " ".join(rng.choice(WORDS) for _ in range(k))
        if i % 5 == 1:
            text = text.replace(" a ", "\na\n")
        docs.append(text)
    if n > 3:
        docs[2] = ""
    return docs


def write_docs(path: Path, docs: Sequence[str], field: str = "text") -> Path:
    """The documents in the format of `path`'s suffix (a folder of .txt files for a path without one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif suffix == ".csv":
        import csv

        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", field])
            w.writerows([i, d] for i, d in enumerate(docs))
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"id": list(range(len(docs))), field: list(docs)})
        pq.write_table(table, path, row_group_size=max(1, len(docs) // 3))
    elif suffix == ".dataset":
        import datasets

        datasets.Dataset.from_dict({field: list(docs), "id": list(range(len(docs)))}).save_to_disk(str(path))
    elif suffix == ".datasetdict":
        import datasets

        dd = datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({field: list(docs)}),
                "test": datasets.Dataset.from_dict({field: ["held out, never read"] * 3}),
            }
        )
        dd.save_to_disk(str(path))
    elif suffix == "":
        path.mkdir()
        for i, d in enumerate(docs):  # names sort in document order
            (path / f"doc-{i:05d}.txt").write_text(d, encoding="utf-8")
    else:
        raise ValueError(suffix)
    return path


def run(*args: str) -> tuple[int, str]:
    """`llmctl ARGS` in this process: (exit code, output: stdout and stderr)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def stream(out: Path, split: str = "train") -> np.ndarray:
    tokens, _ = open_prepared(out, split)
    return tokens[:]


def is_val(i: int, fraction: float) -> bool:
    """The documented rule, written out again: floor((i+1)F) > floor(iF) with F as its exact decimal."""
    from fractions import Fraction

    f = Fraction(repr(fraction))
    return int((i + 1) * f) > int(i * f)


def expected_splits(docs: Sequence[str], tokenizer: str | None, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token streams by the engine's one-process `tokenize`, one document at a time."""
    from llmctl.data.tokenizer import load_tokenizer
    from llmctl.engine.data import tokenize

    tok = load_tokenizer(tokenizer)
    train = [d for i, d in enumerate(docs) if not is_val(i, fraction)]
    val = [d for i, d in enumerate(docs) if is_val(i, fraction)]
    return tokenize(train, tok), tokenize(val, tok)


def leftovers(folder: Path) -> list[str]:
    """Hidden temporary folders a prepare left beside its output."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
