"""Training data: tokenize local text, pack it into sequence-length blocks, give each rank its own micro-batches.

Sources (plan `data.kind`):
- tokens:    a folder made by `llmctl data prepare` (memory-mapped shards, llmctl.data.format; a train and a val
             split) or a single `.bin` token file (+ `.bin.json`) from `python -m llmctl.engine.data build`. Opening
             costs O(shards); only the blocks a rank uses are read. Data made with another tokenizer than the plan
             names (data.tokenizer, or the model.weights folder's) is refused by fingerprint.
- text:      small local .txt / .jsonl files (or folders of them), read whole and tokenized at start on every
             rank with a local Hugging Face tokenizer folder or the built-in byte-level tokenizer (bytes 0..255,
             BOS 256, EOS 257: the `llama-tiny` and `gpt2-tiny` presets have vocab 320 = 258 padded to 64).
- synthetic: uniform random tokens (benchmarks).

Validation (`data.val`): the val split of the prepared folder, or separate files; its blocks in order, unshuffled
(llmctl.engine.evaluate picks the fixed set of sequences).

Order: the token stream is cut into blocks of seq_len + 1 tokens (inputs and next-token targets; consecutive
blocks share one boundary token). Global sample g is block perm_e[g mod n] with e = g // n and perm_e a
permutation seeded by (seed, e): a pure function of the seed and the sample index, so a resumed run reads
exactly what the uninterrupted run would have. Step s consumes global samples [s*G, (s+1)*G) (G = global batch);
rank r takes the contiguous slice r*mbs*acc ... and splits it into `acc` micro-batches of `mbs`, so mbs 2 x acc 1
and mbs 1 x acc 2 see the same samples per step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llmctl.errors import InputError, LlmctlError, report
from llmctl.fileio import load_json
from llmctl.spec.planfile import DataSection

if TYPE_CHECKING:
    import torch

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; BOS/EOS ids follow the byte range (256, 257), as in the tiny presets."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def fingerprint(self) -> str:
        """Identifies the vocabulary: two tokenizers with the same fingerprint map text to the same ids."""
        return hashlib.sha256(b"llmctl-bytes-v1:bos=256,eos=257").hexdigest()


class HFTokenizer:
    """A tokenizer from a local Hugging Face folder (never downloads)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise InputError(
                f"data.tokenizer: cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}"
            ) from None
        self.name = str(path)
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """The fast tokenizer's batch call (Rust, one call for many documents)."""
        return self._tok(list(texts), add_special_tokens=False)["input_ids"]

    def fingerprint(self) -> str:
        """sha256 of the tokenizer's canonical serialization (vocabulary, merges, normalizer, pre-tokenizer, added
        tokens) plus its BOS/EOS ids: independent of file layout, changed by anything that changes the ids."""
        h = hashlib.sha256()
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is not None:
            h.update(backend.to_str().encode())
        else:  # a slow (Python) tokenizer: its vocabulary, sorted
            h.update(json.dumps(sorted(self._tok.get_vocab().items())).encode())
        h.update(f"|bos={self.bos_id}|eos={self.eos_id}".encode())
        return h.hexdigest()


def load_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)


def expand_paths(paths: Sequence[str], key: str = "data.paths") -> list[Path]:
    """Files as given, folders expanded to their text files (sorted, so the order never depends on the disk)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        elif p.is_file():
            out.append(p)
        else:
            raise InputError(f"{key}: {str(p)!r} does not exist")
    if not out:
        raise InputError(f"{key}: no text files found in {list(paths)}")
    return out


def iter_documents(files: Iterable[Path], jsonl_field: str = "text") -> Iterable[str]:
    """One document per .txt file, one per line of a .jsonl file (its `jsonl_field`)."""
    for f in files:
        try:
            if f.suffix == ".jsonl":
                for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise InputError(f"{f}:{n}: not valid JSON ({e.msg})") from None
                    if not isinstance(row, dict) or not isinstance(row.get(jsonl_field), str):
                        raise InputError(f"{f}:{n}: no string field {jsonl_field!r}", hint="set data.jsonl_field")
                    yield row[jsonl_field]
            else:
                yield f.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise InputError(f"{f}: cannot read ({e.strerror})") from None


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenize(docs: Iterable[str], tok: Tokenizer) -> np.ndarray:
    """Concatenate documents as [BOS] doc [EOS] ... into one token array."""
    parts: list[np.ndarray] = []
    dtype = token_dtype(tok.vocab_size)
    for d in docs:
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(d)
        ids += [tok.eos_id] if tok.eos_id is not None else []
        parts.append(np.asarray(ids, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# --- the memory-mapped token format --------------------------------------------------------------------------
def write_token_file(out: str | Path, tokens: np.ndarray, tok: Tokenizer) -> dict[str, Any]:
    """Raw little-endian tokens in OUT and their metadata in OUT.json (written last: it marks completeness)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tokens.astype(tokens.dtype.newbyteorder("<")).tofile(tmp)
    tmp.replace(out)
    meta = {
        "format": "llmctl-tokens",
        "version": 1,
        "dtype": tokens.dtype.name,
        "num_tokens": int(tokens.size),
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.name,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
    }
    Path(str(out) + ".json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def open_token_file(path: str | Path) -> tuple[np.ndarray, dict[str, Any]]:
    path = Path(path)
    meta_path = Path(str(path) + ".json")
    if not path.is_file() or not meta_path.is_file():
        raise InputError(
            f"data.paths: {str(path)!r} is not a token file (needs {path.name} and {meta_path.name})",
            hint="build one with `python -m llmctl.engine.data build --out FILE.bin TEXT...`",
        )
    meta = load_json(meta_path, "token-file metadata")  # one line for unreadable, empty, not JSON, too large
    try:
        dtype = np.dtype(meta["dtype"]).newbyteorder("<")  # type: ignore[index]
        n = int(meta["num_tokens"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{meta_path}: malformed token metadata ({e})") from None
    if path.stat().st_size != n * dtype.itemsize:
        raise InputError(
            f"{path}: size does not match its metadata ({n} tokens of {dtype.name})", hint="rebuild the token file"
        )
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)), meta


# --- blocks, order, and per-rank micro-batches -----------------------------------------------------------------
@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor


class PackedBlocks:
    """Sequence-length blocks over one token stream, in a seeded per-epoch order."""

    def __init__(self, tokens: Any, seq_len: int, seed: int, what: str = "data", shuffle: bool = True) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_blocks = (len(tokens) - 1) // seq_len
        if self.num_blocks < 1:
            raise InputError(
                f"{what}: {len(tokens)} tokens is less than one block of training.seq_len {seq_len}",
                hint="use more text or a shorter seq_len",
            )
        self._perm: tuple[int, np.ndarray] | None = None

    def block_of(self, sample: int) -> int:
        if not self.shuffle:
            return sample % self.num_blocks
        epoch, pos = divmod(sample, self.num_blocks)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks))
        return int(self._perm[1][pos])

    def samples(self, start: int, count: int) -> np.ndarray:
        """(count, seq_len + 1) int64 array of global samples start .. start + count - 1."""
        s = self.seq_len
        rows = [np.asarray(self.tokens[b * s : b * s + s + 1]) for b in map(self.block_of, range(start, start + count))]
        return np.stack(rows).astype(np.int64)


class SyntheticBlocks:
    """Uniform random tokens; sample g is drawn from a generator seeded by (seed, g)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_blocks = 2**62

    def samples(self, start: int, count: int) -> np.ndarray:
        return np.stack(
            [
                np.random.default_rng([self.seed, g]).integers(0, self.vocab_size, self.seq_len + 1)
                for g in range(start, start + count)
            ]
        ).astype(np.int64)


class RankData:
    """The micro-batches one data-parallel rank trains on at a given optimizer step. `dp_rank` and `dp_size` come
    from the plan's ParallelDims (not the global rank and world size: ranks of one tensor-parallel group share data)."""

    def __init__(
        self,
        blocks: PackedBlocks | SyntheticBlocks,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        self.blocks = blocks
        self.mbs, self.acc, self.rank, self.dp_size = micro_batch_size, grad_accum_steps, dp_rank, dp_size

    @property
    def global_batch(self) -> int:
        return self.mbs * self.acc * self.dp_size

    def samples_consumed(self, steps_done: int) -> int:
        """The data position after `steps_done` optimizer steps (stored in checkpoints)."""
        return steps_done * self.global_batch

    def micro_batches(self, step: int) -> list[Batch]:
        import torch

        first = step * self.global_batch + self.rank * self.mbs * self.acc
        arr = torch.from_numpy(self.blocks.samples(first, self.mbs * self.acc))
        return [Batch(inputs=a[:, :-1], targets=a[:, 1:]) for a in arr.split(self.mbs)]


@dataclass(frozen=True)
class Stream:
    """One token stream the data section names, before it is cut into blocks."""

    tokens: Any  # np.ndarray, np.memmap or llmctl.data.format.TokenShards: len() and contiguous slices
    vocab_size: int
    description: str


def check_tokenizer(meta_tokenizer: Any, path: str, expected: Sequence[tuple[str, str]]) -> None:
    """Refuse prepared data whose tokenizer is not the one the plan names (data.tokenizer, or the tokenizer that
    ships in model.weights): same vocabulary size is not enough, the ids must mean the same text."""
    if not isinstance(meta_tokenizer, dict) or not meta_tokenizer.get("fingerprint"):
        return  # an older single .bin token file: only its vocabulary size is known
    for key, folder in expected:
        mine = load_tokenizer(folder).fingerprint()
        if mine != meta_tokenizer["fingerprint"]:
            raise InputError(
                f"data.paths: {path} was prepared with tokenizer {meta_tokenizer.get('name')!r} "
                f"(fingerprint {str(meta_tokenizer['fingerprint'])[:12]}), not the {key} {folder!r} "
                f"(fingerprint {mine[:12]})",
                hint="prepare the data again with --tokenizer set to the model's tokenizer",
            )


def open_stream(
    data: DataSection, paths: Sequence[str], split: str, key: str, expected: Sequence[tuple[str, str]] = ()
) -> Stream:
    """The tokens of `paths` (of kind data.kind): a prepared folder's `split`, a .bin token file, or text files
    tokenized here."""
    if data.kind == "tokens":
        if len(paths) != 1:
            raise InputError(f"{key}: kind tokens takes exactly one prepared folder or .bin token file")
        if Path(paths[0]).is_dir():  # a prepared folder (open_prepared says it when it is not one)
            from llmctl.data.format import open_prepared

            tokens, meta = open_prepared(paths[0], split)
            check_tokenizer(meta.get("tokenizer"), paths[0], expected)
            name = (meta.get("tokenizer") or {}).get("name")
            return Stream(tokens, int(meta.get("vocab_size", 0)), f"{paths[0]} [{split}] ({name})")
        if split != "train":
            raise InputError(f"{key}: {paths[0]} is a single token file; it has no {split!r} split")
        tokens, meta = open_token_file(paths[0])
        return Stream(tokens, int(meta.get("vocab_size", 0)), f"{paths[0]} ({meta.get('tokenizer')})")
    tok = load_tokenizer(data.tokenizer)
    files = expand_paths(paths, key)
    tokens = tokenize(iter_documents(files, data.jsonl_field), tok)
    return Stream(tokens, tok.vocab_size, f"{len(files)} text files, tokenizer {tok.name}")


def _check_vocab(stream: Stream, model_vocab: int) -> None:
    if stream.vocab_size > model_vocab:
        raise InputError(
            f"data: the tokenizer of {stream.description} has {stream.vocab_size} tokens but the model's "
            f"vocabulary is {model_vocab}",
            hint="set model.overrides.vocab_size or use a matching tokenizer",
        )


def expected_tokenizers(data: DataSection, weights: str | None) -> list[tuple[str, str]]:
    """The tokenizers prepared data must have been made with: data.tokenizer, and the one in model.weights."""
    out = [("data.tokenizer", data.tokenizer)] if data.tokenizer else []
    if weights and any((Path(weights) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        out.append(("tokenizer of model.weights", weights))
    return out


def build_source(
    data: DataSection, seq_len: int, seed: int, model_vocab: int, expected: Sequence[tuple[str, str]] = ()
) -> tuple[PackedBlocks | SyntheticBlocks, str]:
    """The plan's training data -> blocks, and one line describing them for the log."""
    if data.kind == "synthetic":
        return SyntheticBlocks(model_vocab, seq_len, seed), f"synthetic tokens, vocab {model_vocab}"
    stream = open_stream(data, data.paths, "train", "data.paths", expected)
    _check_vocab(stream, model_vocab)
    blocks = PackedBlocks(stream.tokens, seq_len, seed, what="data.paths")
    return blocks, f"{stream.description}: {len(stream.tokens):,} tokens, {blocks.num_blocks:,} blocks of {seq_len}"


def build_val_source(
    data: DataSection, seq_len: int, model_vocab: int, expected: Sequence[tuple[str, str]] = ()
) -> tuple[PackedBlocks, str] | None:
    """The validation blocks (in order, not shuffled), or None without data.val."""
    if data.val is None:
        return None
    if data.val == "split":
        stream = open_stream(data, data.paths, "val", "data.val", expected)
    else:
        stream = open_stream(data, data.val, "train", "data.val", expected)
    _check_vocab(stream, model_vocab)
    blocks = PackedBlocks(stream.tokens, seq_len, 0, what="data.val", shuffle=False)
    return blocks, f"{stream.description}: {len(stream.tokens):,} tokens, {blocks.num_blocks:,} blocks of {seq_len}"


# --- `python -m llmctl.engine.data build` ------------------------------------------------------------------------
def build_main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m llmctl.engine.data",
        description="Build a memory-mapped token file (data.kind: tokens) from text.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="tokenize .txt/.jsonl files (or folders) into OUT (+ OUT.json)")
    b.add_argument("inputs", nargs="+", help="text files or folders (.txt, .md, .rst, .jsonl)")
    b.add_argument("--out", required=True, help="output token file, e.g. data/corpus.bin")
    b.add_argument("--tokenizer", default=None, help="local Hugging Face tokenizer folder (default: bytes)")
    b.add_argument("--jsonl-field", default="text", help="field holding the text in .jsonl rows")
    # `llmctl data prepare` is the scalable way (parallel, sharded, parquet and datasets, a validation split).
    args = ap.parse_args(argv)
    try:
        tok = load_tokenizer(args.tokenizer)
        files = expand_paths(args.inputs, key="inputs")
        tokens = tokenize(iter_documents(files, args.jsonl_field), tok)
        meta = write_token_file(args.out, tokens, tok)
    except LlmctlError as e:
        return report(e)
    print(
        f"wrote {args.out}: {meta['num_tokens']:,} tokens ({meta['dtype']}) from {len(files)} files, "
        f"tokenizer {tok.name}, vocab {tok.vocab_size}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(build_main())
