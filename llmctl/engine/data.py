"""Training data: tokenize local text, pack it into sequence-length blocks, give each rank its own micro-batches.

Sources (plan `data.kind`):
- tokens:    a folder made by `llmctl data prepare` (memory-mapped shards, llmctl.data.format; a train and a val
             split), the one token format. Opening costs O(shards); only the blocks a rank uses are read. Data made
             with another tokenizer than the plan names (data.tokenizer, or the model.weights folder's) is refused
             by fingerprint.
- text:      small local .txt / .jsonl files (or folders of them), read whole and tokenized at start on every
             rank with a local Hugging Face tokenizer folder or the built-in byte-level tokenizer (bytes 0..255,
             BOS 256, EOS 257: the `llama-tiny` and `gpt2-tiny` presets have vocab 320 = 258 padded to 64;
             llmctl.data.tokenizer, shared with `llmctl data prepare`).
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

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmctl.data.check import check_tokenizer, check_vocab, expand_paths
from llmctl.data.check import expected_tokenizers as _expected
from llmctl.data.format import open_prepared
from llmctl.data.tokenizer import Tokenizer, load_tokenizer, token_dtype
from llmctl.errors import InputError
from llmctl.spec.planfile import DataSection

if TYPE_CHECKING:
    import torch


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


def tokenize(docs: Iterable[str], tok: Tokenizer) -> np.ndarray:
    """Concatenate documents as [BOS] doc [EOS] ... into one token array."""
    parts: list[np.ndarray] = []
    dtype = token_dtype(tok.vocab_size)
    for d in docs:
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(d)
        ids += [tok.eos_id] if tok.eos_id is not None else []
        parts.append(np.asarray(ids, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


# --- blocks, order, and per-rank micro-batches -----------------------------------------------------------------
@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    """Each token's position in its sequence; None: 0..s-1 (set when context parallelism holds part of one)."""


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

    tokens: Any  # np.ndarray or llmctl.data.format.TokenShards: len() and contiguous slices
    vocab_size: int
    description: str


def open_stream(
    data: DataSection, paths: Sequence[str], split: str, key: str, expected: Sequence[tuple[str, str]] = ()
) -> Stream:
    """The tokens of `paths` (of kind data.kind): a prepared folder's `split`, or text files tokenized here."""
    if data.kind == "tokens":
        if len(paths) != 1:
            raise InputError(f"{key}: kind tokens takes exactly one folder made by `llmctl data prepare`")
        path = Path(paths[0])
        if path.is_file():
            # The older single-file format (FILE.bin + FILE.bin.json, from a build command since removed) or any
            # other file: one line at start that says what to run instead.
            what = "a single .bin token file (the old format, no longer read)" if path.suffix == ".bin" else "a file"
            raise InputError(
                f"{key}: {path} is {what}; data.kind tokens reads a folder made by `llmctl data prepare`",
                hint=f"run `llmctl data prepare TEXT... --out FOLDER` and name FOLDER in {key}",
            )
        tokens, meta = open_prepared(path, split)  # one line when it is missing or not a prepared folder
        check_tokenizer(meta.get("tokenizer"), paths[0], expected)
        name = (meta.get("tokenizer") or {}).get("name")
        return Stream(tokens, int(meta.get("vocab_size", 0)), f"{paths[0]} [{split}] ({name})")
    tok = load_tokenizer(data.tokenizer)
    files = expand_paths(paths, key)
    tokens = tokenize(iter_documents(files, data.jsonl_field), tok)
    return Stream(tokens, tok.vocab_size, f"{len(files)} text files, tokenizer {tok.name}")


def _check_vocab(stream: Stream, model_vocab: int) -> None:
    check_vocab(stream.vocab_size, model_vocab, stream.description)


def expected_tokenizers(data: DataSection, weights: str | None) -> list[tuple[str, str]]:
    """The tokenizers prepared data must have been made with: data.tokenizer, and the one in model.weights."""
    return _expected(data.tokenizer, weights)


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
