"""The prepared-dataset folder (what `llmctl data prepare` writes and the engine reads). Torch-free, numpy only.

    OUT/meta.json            written last: its presence marks a complete dataset
    OUT/train-00000.bin ...  raw little-endian tokens of the train split, in document order
    OUT/val-00000.bin ...    the same for the validation split (possibly no shard at all)
    OUT/train-00000.flags.bin ...  packed instruction data only (`--instruction`): one uint8 per token, the shards
                             cut exactly as the token shards (same token counts)

A split is one token stream cut into shards of at most `shard_tokens` tokens; a shard boundary may cut a document.
meta.json (version 1):

    {"format": "llmctl-prepared", "version": 1, "dtype": "uint16" | "uint32", "vocab_size": int,
     "tokenizer": {"name": str, "fingerprint": str, "bos_id": int | null, "eos_id": int | null},
     "seq_len": int | null, "val_fraction": float,
     "splits": {"train": {"documents": int, "tokens": int, "shards": [{"file": "train-00000.bin", "tokens": int}]},
                "val": {...}},
     "sources": [str], "text_field": str, "seconds": float}

Packed instruction data (`llmctl data prepare --instruction`, llmctl.data.instruct) adds, per split, "flags" (the
flags shards, listed like "shards") and "packed": {"seq_len": S, "examples": n, "truncated": n, "dropped": n,
"loss_tokens": n}, and at the top level "chat_template": "tokenizer" | "llmctl-plain-v1". Its stream is a whole
number of packs of exactly S tokens. A token's flags: bit 0 (1) = it is a loss target (predicting it from the previous
token counts), bit 1 (2) = it starts a document (an example, or a run of padding: every pack starts with one).
"loss_tokens" counts the tokens with bit 0 (never set on a document's first token). A folder without "flags" reads
exactly as before (plain text: every token a target).

Opening a split costs O(shards): metadata and file sizes are checked, no token is read until it is sliced.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.errors import InputError, LlmctlError

META_FILE = "meta.json"
FORMAT = "llmctl-prepared"
VERSION = 1
SPLITS = ("train", "val")
DTYPES = ("uint16", "uint32")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def flags_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.flags.bin"


def is_prepared(path: str | Path) -> bool:
    """A folder holding META_FILE (a complete `llmctl data prepare` output, or a damaged one open_prepared names)."""
    p = Path(path)
    return p.is_dir() and (p / META_FILE).is_file()


class TokenShards:
    """One split's token stream: the read-only concatenation of its shards, each memory-mapped on first use.

    `len()` is the number of tokens; `[start:stop]` (step 1) is a numpy array of those tokens (a view of the
    memory map inside one shard, a copy across shards); `[i]` is one token. Pickles without its memory maps (a data
    loader worker maps the shards again)."""

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype) -> None:
        if len(files) != len(counts):
            raise ValueError("one token count per shard file")
        self.files = list(files)
        self.counts = [int(c) for c in counts]
        self.dtype = np.dtype(dtype)
        self.starts = [0]  # starts[k]: the stream position of shard k's first token; starts[-1]: the total
        for c in self.counts:
            self.starts.append(self.starts[-1] + c)
        self._maps: dict[int, np.memmap] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __repr__(self) -> str:
        return f"TokenShards({len(self):,} tokens of {self.dtype.name} in {len(self.files)} shards)"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}

    def _map(self, k: int) -> np.memmap:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.files[k], dtype=self.dtype, mode="r", shape=(self.counts[k],))
        return self._maps[k]

    def _shard_of(self, pos: int) -> int:
        """The shard holding stream position `pos` (0 <= pos < len)."""
        return bisect.bisect_right(self.starts, pos) - 1

    def __getitem__(self, index: int | slice) -> Any:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                raise IndexError("TokenShards supports contiguous slices only (step 1)")
            return self._read(start, max(start, stop))
        if isinstance(index, (int, np.integer)):
            i = int(index) + (n if index < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"token index {int(index)} out of range for {n} tokens")
            k = self._shard_of(i)
            return self._map(k)[i - self.starts[k]]
        raise TypeError(f"TokenShards indices are ints or slices, not {type(index).__name__}")

    def _read(self, start: int, stop: int) -> np.ndarray:
        if start == stop:
            return np.zeros(0, dtype=self.dtype)
        first, last = self._shard_of(start), self._shard_of(stop - 1)
        if first == last:
            base = self.starts[first]
            return np.asarray(self._map(first)[start - base : stop - base])
        parts = []
        for k in range(first, last + 1):
            lo = max(start, self.starts[k]) - self.starts[k]
            hi = min(stop, self.starts[k + 1]) - self.starts[k]
            parts.append(self._map(k)[lo:hi])
        return np.concatenate(parts)


def _fail(path: Path, problem: str, hint: str | None = "prepare it again with `llmctl data prepare`") -> InputError:
    return InputError(f"{path}: {problem}", hint=hint)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The metadata of a prepared folder, checked for format and version (one InputError line otherwise)."""
    from llmctl.fileio import load_json

    p = Path(path)
    if not p.is_dir():
        what = "does not exist" if not p.exists() else "is not a folder"
        raise InputError(f"{p}: {what}; expected a folder made by `llmctl data prepare`")
    if not (p / META_FILE).is_file():
        raise _fail(p, f"is not a prepared dataset (no {META_FILE}: an interrupted `llmctl data prepare`?)")
    try:
        meta = load_json(p / META_FILE, "prepared-dataset metadata")
    except LlmctlError as e:
        raise InputError(e.message, hint="prepare it again with `llmctl data prepare`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _fail(p, f"{META_FILE} is not a {FORMAT} description (format {found!r})")
    if meta.get("version") != VERSION:
        raise _fail(
            p,
            f"{META_FILE} has version {meta.get('version')!r}; this llmctl reads version {VERSION}",
            hint="prepare it again with this llmctl, or use the llmctl that wrote it",
        )
    if meta.get("dtype") not in DTYPES:
        raise _fail(p, f"{META_FILE}: dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(meta.get("splits"), dict):
        raise _fail(p, f"{META_FILE}: no 'splits' mapping")
    return meta


def _shard_list(p: Path, split: str, entry: Any) -> tuple[list[Path], list[int], int]:
    """(shard files, their token counts, the split's token count), checked against the metadata and the disk."""
    try:
        shards = entry["shards"]
        total = int(entry["tokens"])
        names = [str(s["file"]) for s in shards]
        counts = [int(s["tokens"]) for s in shards]
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(p, f"{META_FILE}: malformed split {split!r} ({type(e).__name__}: {e})") from None
    for name, count in zip(names, counts):
        # A bare file name: metadata must not point outside its folder ("../../x.bin", "/etc/passwd").
        if name != Path(name).name or name in ("", ".", "..") or count < 0:
            raise _fail(p, f"{META_FILE}: split {split!r} has a bad shard entry {name!r} ({count} tokens)")
    if sum(counts) != total:
        raise _fail(p, f"{META_FILE}: split {split!r} says {total} tokens but its shards hold {sum(counts)}")
    return [p / n for n in names], counts, total


def open_prepared(path: str | Path, split: str = "train") -> tuple[TokenShards, dict[str, Any]]:
    """The tokens of one split of a prepared folder and the folder's metadata. One InputError line for: no
    meta.json, another format or version, an unknown or empty split, a missing shard, a shard whose size does not
    match its metadata."""
    p = Path(path)
    meta = read_meta(p)
    splits = meta["splits"]
    if split not in splits:
        raise InputError(f"{p}: no split {split!r} (it has: {', '.join(map(str, splits)) or 'none'})")
    files, counts, total = _shard_list(p, split, splits[split])
    if total == 0:
        hint = "prepare it with --val-fraction > 0" if split == "val" else "prepare it from more text"
        raise InputError(f"{p}: split {split!r} has no tokens", hint=hint)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    return _checked_shards(p, split, files, counts, dtype), meta


def open_flags(path: str | Path, split: str, meta: dict[str, Any]) -> tuple[TokenShards, dict[str, Any]] | None:
    """The per-token flags of a packed split (uint8, aligned with its tokens) and its "packed" entry, or None for
    plain data (no "flags")."""
    p = Path(path)
    entry = meta["splits"][split]
    if not isinstance(entry, dict) or "flags" not in entry:
        return None
    files, counts, total = _shard_list(p, split, {"shards": entry["flags"], "tokens": entry.get("tokens")})
    if counts != [int(s["tokens"]) for s in entry["shards"]]:
        raise _fail(p, f"{META_FILE}: split {split!r} has flags shards cut unlike its token shards")
    packed = entry.get("packed")
    if not isinstance(packed, dict) or not isinstance(packed.get("seq_len"), int) or packed["seq_len"] < 1:
        raise _fail(p, f"{META_FILE}: split {split!r} has flags but no 'packed' entry with a positive seq_len")
    if total % packed["seq_len"]:
        raise _fail(p, f"{META_FILE}: split {split!r} holds {total} tokens, not whole packs of {packed['seq_len']}")
    return _checked_shards(p, split, files, counts, np.dtype(np.uint8)), packed


def _checked_shards(p: Path, split: str, files: list[Path], counts: list[int], dtype: np.dtype) -> TokenShards:
    for f, count in zip(files, counts):
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise _fail(p, f"shard {f.name} of split {split!r} is missing") from None
        except OSError as e:
            raise _fail(p, f"cannot read shard {f.name} ({e.strerror})") from None
        if size != count * dtype.itemsize:
            raise _fail(
                p,
                f"shard {f.name} has {size} bytes; its metadata says {count} tokens of {dtype.name} ({count * dtype.itemsize} bytes)",
            )
    keep = [i for i, c in enumerate(counts) if c > 0]  # an empty file cannot be memory-mapped
    return TokenShards([files[i] for i in keep], [counts[i] for i in keep], dtype)
