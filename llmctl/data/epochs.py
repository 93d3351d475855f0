"""Epochs: a run's length counted in passes over its prepared data set (`llmctl plan --epochs N`), and the warning
when a plan's steps pass over it more than a few times (`plan`, `launch --dry-run`). Torch-free.

A pass is every training sequence the engine cuts from the set once: `blocks_in` counts them as the engine's data
source does (llmctl.engine.data), so `--epochs 1` is exactly one shuffled pass. Text files (data.kind text) are
tokenized only when the run starts, so their size in sequences is not known here: --epochs needs a prepared folder.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from llmctl.errors import InputError

if TYPE_CHECKING:
    from llmctl.spec.planfile import Plan

MANY_PASSES = 4.0
"""Passes over the data past which a plan warns. Muennighoff et al. 2023 ("Scaling Data-Constrained Language
Models", arXiv 2305.16264): up to ~4 epochs of repeated data train about as well as fresh data, beyond that the
returns fall off quickly; fine-tuning recipes use 1-3 epochs. More is sometimes meant (a tiny demo), never silently."""


def blocks_in(tokens: int, seq_len: int, packed: bool = False) -> int:
    """Training sequences of `seq_len` in a stream of `tokens`: packs of exactly seq_len (instruction data) are each
    one; a plain stream gives (tokens - 1) // seq_len blocks (each block's targets run one token past its inputs)."""
    return tokens // seq_len if packed else (tokens - 1) // seq_len


def set_sequences(path: str, seq_len: int) -> int:
    """The training sequences a pass over the prepared folder `path` holds at `seq_len` (its packs' length for
    instruction data, which the engine requires)."""
    from llmctl.data.format import read_meta

    train = read_meta(path)["splits"].get("train") or {}
    packed = train.get("packed") or {}
    tokens = int(train.get("tokens", 0) or 0)
    return blocks_in(tokens, int(packed.get("seq_len") or seq_len), packed=bool(packed))


def epoch_steps(epochs: float, data: list[str] | None, seq_len: int, global_batch: int) -> tuple[int, str]:
    """Optimizer steps for `epochs` passes over the prepared folder in `data` at `global_batch` sequences per step,
    with the line that says so; one InputError line when the set's size is not known here."""
    if not epochs > 0 or not math.isfinite(epochs):
        raise InputError(f"--epochs must be a positive number, got {epochs}")
    if not data or len(data) != 1:
        raise InputError(
            "--epochs needs --data with one folder made by `llmctl data prepare` (its size sets the steps)",
            hint="or give the run's length with --tokens",
        )
    from llmctl.data.format import META_FILE

    if not (Path(data[0]) / META_FILE).is_file():
        raise InputError(
            f"--epochs: {data[0]} is not a prepared folder; text files are tokenized only when the run starts, so "
            "their size in sequences is not known here",
            hint=f"prepare it first (`llmctl data prepare {data[0]} --out DIR`), or give the length with --tokens",
        )
    sequences = set_sequences(data[0], seq_len)
    if sequences < 1:
        raise InputError(f"--epochs: {data[0]} holds no training sequence of {seq_len} tokens")
    steps = max(1, math.ceil(epochs * sequences / global_batch))
    return steps, f"--epochs {epochs:g}: {sequences:,} sequences a pass / {global_batch:,} per step = {steps:,} steps"


def passes(plan: Plan) -> float | None:
    """How many times the plan's steps pass over its training data (None: not known here: text or synthetic data,
    or a folder that cannot be read, which the run itself reports)."""
    d = plan.data
    if d.kind != "tokens" or len(d.paths) != 1:
        return None
    try:
        sequences = set_sequences(d.paths[0], plan.training.seq_len)
    except InputError:
        return None
    if sequences < 1:
        return None
    per_step = plan.tokens_per_step // plan.training.seq_len
    return plan.total_steps * per_step / sequences


def many_passes_warning(plan: Plan) -> str | None:
    """One line when the plan passes over its data more than MANY_PASSES times, else None."""
    n = passes(plan)
    if n is None or n <= MANY_PASSES:
        return None
    return (
        f"{plan.total_steps:,} steps pass over the training data {n:,.1f} times (more than {MANY_PASSES:g} repeats "
        "train little better than fewer: set the length with `llmctl plan --epochs N`, or --tokens)"
    )
