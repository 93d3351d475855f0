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

Packed instruction data (a prepared folder with flags, `llmctl data prepare --instruction`): `PackedExamples`.
Block b is the pack tokens [b*S, (b+1)*S) (no shared boundary token); inputs are its S tokens, targets[j] =
tokens[j+1] where token j+1 is a loss target and does not start a document, else -100 (the last position too);
positions restart at 0 at each document start. With no attention mask, transformers reads packed sequences from
the positions (masking_utils.find_packed_sequence_indices: a position step other than +1 starts a sequence) and
builds a block-causal mask for sdpa/eager; flash-attention 2 runs varlen from them: no token attends across a
document boundary. Every micro-batch of a step carries `loss_divisor` = (the loss tokens of the step's whole global
batch) / dp: the backward of sum(loss) / loss_divisor on each rank, averaged over the dp ranks by FSDP2, is the mean
over all the step's loss tokens, whatever their spread over micro-batches and ranks (HF Trainer's gradient
accumulation bug of 2024 was a per-micro-batch mean). Each rank counts the step's loss tokens from the flags alone.

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
from llmctl.data.epochs import blocks_in
from llmctl.data.format import open_flags, open_prepared
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
    """Each token's position in its sequence; None: 0..s-1 (set when context parallelism holds part of one, and for
    packed examples: restarting at 0 at each document)."""
    loss_divisor: float | None = None
    """Packed data: the step's loss is sum(losses) / loss_divisor (global loss tokens of the step / dp); None: the
    micro-batch's mean, divided by grad_accum_steps."""


class PackedBlocks:
    """Sequence-length blocks over one token stream, in a seeded per-epoch order."""

    def __init__(self, tokens: Any, seq_len: int, seed: int, what: str = "data", shuffle: bool = True) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_blocks = blocks_in(len(tokens), seq_len)  # what `plan --epochs` counts too
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


IGNORE = -100
"""torch.nn.functional.cross_entropy's default ignore_index."""
LOSS, DOC_START = 1, 2
"""Flag bits of packed data (llmctl.data.format): a loss target; a document's first token."""


def packed_rows(tokens: np.ndarray, flags: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, positions), each (n, S) int64, of n packs of S tokens and their flags (module docstring)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    flags = np.asarray(flags, dtype=np.uint8)
    n, s = tokens.shape
    starts = (flags & DOC_START) != 0
    starts[:, 0] = True  # every pack starts a document
    targets = np.full((n, s), IGNORE, dtype=np.int64)
    counts = ((flags[:, 1:] & LOSS) != 0) & ~starts[:, 1:]
    targets[:, :-1] = np.where(counts, tokens[:, 1:], IGNORE)
    idx = np.broadcast_to(np.arange(s), (n, s))
    positions = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return tokens, targets, positions.astype(np.int64)


def one_row(batch: Batch) -> Batch:
    """A packed micro-batch (b, S) as one row (1, b*S): flash-attention 2 goes varlen from the positions only for a
    batch of one (transformers' modeling_flash_attention_utils._is_packed_sequence); with more rows it would attend
    across documents. Every pack starts a document, so the row holds the same documents and targets."""
    pos = None if batch.positions is None else batch.positions.reshape(1, -1)
    return Batch(batch.inputs.reshape(1, -1), batch.targets.reshape(1, -1), pos, batch.loss_divisor)


class PackedExamples(PackedBlocks):
    """Packs of exactly seq_len tokens with per-token flags, in the same seeded per-epoch order as PackedBlocks."""

    loss_token_fraction: float | None = None
    """The share of the split's tokens that are loss targets (its meta.json), for the start event."""

    def __init__(
        self, tokens: Any, flags: Any, seq_len: int, seed: int, what: str = "data", shuffle: bool = True
    ) -> None:
        self.tokens, self.flags = tokens, flags
        self.seq_len, self.seed, self.shuffle = seq_len, seed, shuffle
        self.num_blocks = blocks_in(len(tokens), seq_len, packed=True)
        if self.num_blocks < 1:
            raise InputError(f"{what}: no pack of {seq_len} tokens", hint="prepare it again with more records")
        self._perm = None

    def _rows(self, data: Any, start: int, count: int) -> np.ndarray:
        s = self.seq_len
        return np.stack(
            [np.asarray(data[b * s : (b + 1) * s]) for b in map(self.block_of, range(start, start + count))]
        )

    def samples(self, start: int, count: int) -> np.ndarray:
        """(count, seq_len) int64 tokens of global samples start .. start + count - 1."""
        return self._rows(self.tokens, start, count).astype(np.int64)

    def batch(self, start: int, count: int) -> Batch:
        import torch

        inputs, targets, positions = packed_rows(
            self._rows(self.tokens, start, count), self._rows(self.flags, start, count)
        )
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(positions))

    def loss_tokens(self, start: int, count: int) -> int:
        """The targets of samples start .. start + count - 1 (read from their flags only: one byte a token)."""
        f = self._rows(self.flags, start, count)
        return int(np.count_nonzero(((f[:, 1:] & LOSS) != 0) & ((f[:, 1:] & DOC_START) == 0)))


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
        if isinstance(self.blocks, PackedExamples):
            divisor = max(1, self.step_loss_tokens(step)) / self.dp_size
            out = []
            for m in range(self.acc):
                b = self.blocks.batch(first + m * self.mbs, self.mbs)
                b.loss_divisor = divisor
                out.append(b)
            return out
        arr = torch.from_numpy(self.blocks.samples(first, self.mbs * self.acc))
        return [Batch(inputs=a[:, :-1], targets=a[:, 1:]) for a in arr.split(self.mbs)]

    def step_loss_tokens(self, step: int) -> int:
        """The loss targets of step `step`'s whole global batch (every rank's samples; packed data only)."""
        if not isinstance(self.blocks, PackedExamples):
            raise TypeError("loss tokens are counted for packed data only")
        return self.blocks.loss_tokens(step * self.global_batch, self.global_batch)

    def step_fields(self, step: int) -> dict[str, Any]:
        """What a step record says about step `step`'s data (0-based): the share of its tokens that are loss targets
        (packed data), else nothing."""
        if not isinstance(self.blocks, PackedExamples):
            return {}
        return {"loss_token_fraction": self.step_loss_tokens(step) / (self.global_batch * self.blocks.seq_len)}


@dataclass(frozen=True)
class Stream:
    """One token stream the data section names, before it is cut into blocks."""

    tokens: Any  # np.ndarray or llmctl.data.format.TokenShards: len() and contiguous slices
    vocab_size: int
    description: str
    flags: Any = None
    """Packed instruction data: the per-token flags (llmctl.data.format) and its "packed" entry; None: plain."""
    packed: dict[str, Any] | None = None


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
        flags = open_flags(path, split, meta)
        desc = f"{paths[0]} [{split}] ({name})"
        if flags is None:
            return Stream(tokens, int(meta.get("vocab_size", 0)), desc)
        return Stream(tokens, int(meta.get("vocab_size", 0)), desc, flags[0], flags[1])
    tok = load_tokenizer(data.tokenizer)
    files = expand_paths(paths, key)
    tokens = tokenize(iter_documents(files, data.jsonl_field), tok)
    return Stream(tokens, tok.vocab_size, f"{len(files)} text files, tokenizer {tok.name}")


def _check_vocab(stream: Stream, model_vocab: int) -> None:
    check_vocab(stream.vocab_size, model_vocab, stream.description)


def expected_tokenizers(data: DataSection, weights: str | None) -> list[tuple[str, str]]:
    """The tokenizers prepared data must have been made with: data.tokenizer, and the one in model.weights."""
    return _expected(data.tokenizer, weights)


def _packed(stream: Stream, seq_len: int, seed: int, key: str, cp: int, shuffle: bool) -> tuple[PackedExamples, str]:
    """Packed instruction data: its packs must be the plan's sequences, and ring attention (cp > 1) ignores the
    document mask (torch's context_parallel runs causal attention over the whole sequence)."""
    packed = stream.packed or {}
    if packed.get("seq_len") != seq_len:
        raise InputError(
            f"{key}: packs of {packed.get('seq_len')} tokens, but training.seq_len is {seq_len}",
            hint=f"set training.seq_len: {packed.get('seq_len')}, or prepare the data again with --seq-len {seq_len}",
        )
    if cp > 1:
        raise InputError(
            f"{key}: packed instruction data with context parallelism (cp {cp}): ring attention would attend across "
            "the packed examples",
            hint="set parallel.cp: 1",
        )
    blocks = PackedExamples(stream.tokens, stream.flags, seq_len, seed, what=key, shuffle=shuffle)
    blocks.loss_token_fraction = share = packed.get("loss_tokens", 0) / max(1, len(stream.tokens))
    return blocks, (
        f"{stream.description}: {packed.get('examples', 0):,} examples packed in {blocks.num_blocks:,} sequences of "
        f"{seq_len}, {share:.1%} loss tokens ({packed.get('truncated', 0)} truncated, {packed.get('dropped', 0)} "
        "dropped)"
    )


def build_source(
    data: DataSection,
    seq_len: int,
    seed: int,
    model_vocab: int,
    expected: Sequence[tuple[str, str]] = (),
    cp: int = 1,
) -> tuple[PackedBlocks | SyntheticBlocks, str]:
    """The plan's training data -> blocks, and one line describing them for the log."""
    if data.kind == "synthetic":
        return SyntheticBlocks(model_vocab, seq_len, seed), f"synthetic tokens, vocab {model_vocab}"
    stream = open_stream(data, data.paths, "train", "data.paths", expected)
    _check_vocab(stream, model_vocab)
    if stream.flags is not None:
        return _packed(stream, seq_len, seed, "data.paths", cp, shuffle=True)
    blocks = PackedBlocks(stream.tokens, seq_len, seed, what="data.paths")
    return blocks, f"{stream.description}: {len(stream.tokens):,} tokens, {blocks.num_blocks:,} blocks of {seq_len}"


def build_val_source(
    data: DataSection, seq_len: int, model_vocab: int, expected: Sequence[tuple[str, str]] = (), cp: int = 1
) -> tuple[PackedBlocks, str] | None:
    """The validation blocks (in order, not shuffled), or None without data.val."""
    if data.val is None:
        return None
    if data.val == "split":
        stream = open_stream(data, data.paths, "val", "data.val", expected)
    else:
        stream = open_stream(data, data.val, "train", "data.val", expected)
    _check_vocab(stream, model_vocab)
    if stream.flags is not None:
        return _packed(stream, seq_len, 0, "data.val", cp, shuffle=False)
    blocks = PackedBlocks(stream.tokens, seq_len, 0, what="data.val", shuffle=False)
    return blocks, f"{stream.description}: {len(stream.tokens):,} tokens, {blocks.num_blocks:,} blocks of {seq_len}"
