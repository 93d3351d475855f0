"""The prepared-folder reader the engine uses: TokenShards slices, and one InputError line for every damaged folder."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from llmctl.data import format as fmt
from llmctl.data.format import META_FILE, TokenShards, is_prepared, open_prepared
from llmctl.errors import InputError


def make_folder(root: Path, splits: dict[str, list[int]], dtype: str = "uint16") -> tuple[Path, dict[str, np.ndarray]]:
    """A prepared folder by hand: each split's shards hold consecutive numbers (shard sizes as given)."""
    root.mkdir(parents=True, exist_ok=True)
    meta_splits, streams, start = {}, {}, 0
    for split, sizes in splits.items():
        shards = []
        for k, n in enumerate(sizes):
            np.arange(start, start + n, dtype=dtype).astype(np.dtype(dtype).newbyteorder("<")).tofile(
                root / f"{split}-{k:05d}.bin"
            )
            shards.append({"file": f"{split}-{k:05d}.bin", "tokens": n})
            start += n
        streams[split] = np.arange(start - sum(sizes), start, dtype=dtype)
        meta_splits[split] = {"documents": len(sizes), "tokens": sum(sizes), "shards": shards}
    meta = {
        "format": "llmctl-prepared",
        "version": 1,
        "dtype": dtype,
        "vocab_size": 70000 if dtype == "uint32" else 60000,
        "tokenizer": {"name": "t", "fingerprint": "f" * 64, "bos_id": None, "eos_id": None},
        "seq_len": None,
        "val_fraction": 0.0,
        "splits": meta_splits,
        "sources": [],
        "text_field": "text",
        "seconds": 0.0,
    }
    (root / META_FILE).write_text(json.dumps(meta))
    return root, streams


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_slices_across_shards_equal_the_concatenation(tmp_path: Path, dtype: str) -> None:
    root, streams = make_folder(tmp_path / "p", {"train": [5, 1, 13, 8], "val": [3]}, dtype)
    tokens, meta = open_prepared(root)
    whole = streams["train"]
    assert isinstance(tokens, TokenShards) and len(tokens) == 27 and tokens.dtype == np.dtype(dtype)
    assert meta["dtype"] == dtype
    for a in range(-3, 30):
        for b in range(-3, 30):
            assert np.array_equal(tokens[a:b], whole[a:b]), (a, b)
    assert tokens[:].dtype == np.dtype(dtype) and [tokens[i] for i in (0, 5, 6, -1)] == [0, 5, 6, 26]
    assert np.array_equal(open_prepared(root, "val")[0][:], streams["val"])
    with pytest.raises(IndexError, match="contiguous"):
        tokens[::2]
    with pytest.raises(IndexError):
        tokens[27]
    copy = pickle.loads(pickle.dumps(tokens))  # a data-loader worker: maps the shards again
    assert np.array_equal(copy[3:20], whole[3:20])


def test_opening_reads_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, streams = make_folder(tmp_path / "p", {"train": [4] * 50})
    maps: list[object] = []
    real = np.memmap

    def counting_memmap(*args: object, **kwargs: object) -> np.memmap:
        maps.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fmt.np, "memmap", counting_memmap)
    tokens, _ = open_prepared(root)
    assert maps == [] and len(tokens) == 200  # O(shards): metadata and file sizes only
    assert np.array_equal(tokens[98:103], streams["train"][98:103]) and len(maps) == 2  # only the shards touched


def test_is_prepared(tmp_path: Path) -> None:
    root, _ = make_folder(tmp_path / "p", {"train": [3]})
    assert is_prepared(root) and is_prepared(str(root))
    assert not is_prepared(tmp_path) and not is_prepared(tmp_path / "nothing") and not is_prepared(root / META_FILE)


def _edit(root: Path, change) -> None:  # type: ignore[no-untyped-def]
    meta = json.loads((root / META_FILE).read_text())
    change(meta)
    (root / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("damage", "split", "message"),
    [
        (lambda r: (r / META_FILE).unlink(), "train", "is not a prepared dataset (no meta.json: an interrupted"),
        (lambda r: (r / META_FILE).write_text(""), "train", "empty prepared-dataset metadata"),
        (lambda r: (r / META_FILE).write_text("{oops"), "train", "is not valid JSON"),
        (lambda r: (r / META_FILE).write_text("[]"), "train", "is not a llmctl-prepared description"),
        (lambda r: _edit(r, lambda m: m.update(format="llmctl-tokens")), "train", "format 'llmctl-tokens'"),
        (lambda r: _edit(r, lambda m: m.update(version=2)), "train", "has version 2; this llmctl reads version 1"),
        (lambda r: _edit(r, lambda m: m.update(dtype="float32")), "train", "dtype 'float32' is not one of"),
        (lambda r: None, "test", "no split 'test' (it has: train, val)"),
        (lambda r: None, "val", "split 'val' has no tokens"),
        (lambda r: (r / "train-00001.bin").unlink(), "train", "shard train-00001.bin of split 'train' is missing"),
        (lambda r: (r / "train-00001.bin").write_bytes(b"\0" * 6), "train", "train-00001.bin has 6 bytes"),
        (
            lambda r: _edit(r, lambda m: m["splits"]["train"]["shards"][0].update(file="../x.bin")),
            "train",
            "bad shard entry '../x.bin'",
        ),
        (
            lambda r: _edit(r, lambda m: m["splits"]["train"].update(tokens=99)),
            "train",
            "says 99 tokens but its shards hold 7",
        ),
        (lambda r: _edit(r, lambda m: m["splits"]["train"].pop("shards")), "train", "malformed split 'train'"),
    ],
)
def test_damaged_folders_are_one_input_error(tmp_path: Path, damage, split: str, message: str) -> None:  # type: ignore[no-untyped-def]
    root, _ = make_folder(tmp_path / "p", {"train": [3, 4], "val": []})
    damage(root)
    with pytest.raises(InputError) as e:
        open_prepared(root, split)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        open_prepared(tmp_path / "missing")
    (tmp_path / "f.bin").write_bytes(b"")
    with pytest.raises(InputError, match="is not a folder"):
        open_prepared(tmp_path / "f.bin")
