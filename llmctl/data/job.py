"""What a `llmctl data prepare` run is asked (`PrepareConfig`) and reports (`Progress`, `PrepareResult`), and the
validation split's rule (`val_ratio`, `is_val`): shared by the document pipeline (llmctl.data.prepare) and the chat
pipeline (llmctl.data.instruct), so neither imports the other's pieces.

Validation split (by document, streaming): with F = --val-fraction = p/q exactly (the shortest decimal of the float),
document i goes to val iff floor((i+1)p/q) > floor(ip/q), so the first n documents hold exactly floor(nF) val
documents spread evenly (Bresenham's line: one every 1/F documents).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from llmctl.errors import InputError

DEFAULT_SHARD_TOKENS = 2**28
"""512 MiB of uint16 per shard: few files for tens of GB, each small enough to copy or checksum on its own."""
MAX_WORKERS = 1024


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a SLURM job's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity
        return os.cpu_count() or 1


@dataclass(frozen=True)
class PrepareConfig:
    inputs: tuple[str, ...]
    """Files and folders (llmctl.data.sources says which kinds)."""
    out: Path
    """The prepared folder to create (a hidden sibling is written, then renamed to it)."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer folder; None: the byte-level tokenizer (bytes 0..255, BOS 256, EOS 257)."""
    seq_len: int | None = None
    """The training sequence length: each split must hold at least one block (seq_len + 1 tokens)."""
    val_fraction: float = 0.0
    """The share of documents in the validation split, in [0, 1)."""
    workers: int = field(default_factory=usable_cores)
    """Tokenizer processes."""
    text_field: str = "text"
    """The field (jsonl) or column (csv, parquet, datasets) holding the text."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """The most tokens in one shard file."""
    force: bool = False
    """Replace an existing prepared --out (only once the new one is complete)."""
    instruction: bool = False
    """Chat records, masked and packed into sequences of exactly seq_len tokens (llmctl.data.instruct)."""
    text_globs: tuple[str, ...] = ()
    """File-name patterns (`*.py`) read as text files (a document each), whatever their suffix."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise InputError("no inputs given", hint="name files or folders to prepare")
        if not 0 <= self.val_fraction < 1:
            raise InputError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise InputError(f"--workers must be between 1 and {MAX_WORKERS}, got {self.workers}")
        if self.seq_len is not None and self.seq_len < 1:
            raise InputError(f"--seq-len must be a positive integer, got {self.seq_len}")
        if self.shard_tokens < 1:
            raise InputError(f"--shard-tokens must be a positive integer, got {self.shard_tokens}")
        if not self.text_field:
            raise InputError("--text-field must not be empty")
        if self.instruction and self.seq_len is None:
            raise InputError(
                "--instruction needs --seq-len: each chat example is packed whole into sequences of exactly that many "
                "tokens, so it must be the plan's training.seq_len",
                hint="pass the plan's sequence length, e.g. --seq-len 2048",
            )
        if self.instruction and self.text_globs:
            raise InputError("--glob reads plain text files; --instruction reads chat records (.jsonl, .parquet)")


@dataclass(frozen=True)
class Progress:
    documents: int
    tokens: int
    seconds: float
    total_documents: int | None
    """All documents of the inputs when every source knows its count (parquet, datasets, text files), else None."""


@dataclass(frozen=True)
class SplitResult:
    documents: int
    tokens: int
    shards: int


@dataclass(frozen=True)
class PrepareResult:
    out: Path
    documents: int
    tokens: int
    splits: dict[str, SplitResult]
    sources: int
    workers: int
    seconds: float
    meta: dict[str, Any]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# --- the validation split --------------------------------------------------------------------------------------
def val_ratio(fraction: float) -> tuple[int, int]:
    """F as an exact ratio p/q of its shortest decimal (0.1 -> 1/10, not 3602879701896397/2**55)."""
    r = Fraction(repr(float(fraction)))
    return r.numerator, r.denominator


def is_val(i: int, p: int, q: int) -> bool:
    """Document i (0-based) goes to the validation split."""
    return (i + 1) * p // q > i * p // q
