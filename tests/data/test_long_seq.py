"""Long sequences end to end (issue 27): `data prepare --seq-len` takes 1M tokens (1,048,576), and the engine's reader
cuts the prepared folder into blocks of 1M + 1 tokens (inputs and next-token targets), also where a block spans
shard files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for data_helpers (tests run with --import-mode=importlib)
from data_helpers import run  # noqa: E402

from llmctl.bounds import LIMITS
from llmctl.spec.planfile import DataSection, TrainingSection

MILLION = 2**20  # 1,048,576: "1M" as lengths in tokens are spelled (llmctl.cli.options.length_count)


@pytest.fixture(scope="module")
def two_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One .txt document of 2 x 1M - 1 bytes: with the byte tokenizer's BOS and EOS, 2 x 1M + 1 tokens, exactly two
    blocks (consecutive blocks share their boundary token)."""
    folder = tmp_path_factory.mktemp("long")
    alphabet = np.frombuffer(b"abcdefghij klmnop\n", dtype=np.uint8)
    text = np.random.default_rng(27).choice(alphabet, 2 * MILLION - 1)
    (folder / "book.txt").write_bytes(text.tobytes())
    return folder / "book.txt"


def test_prepare_takes_a_1m_sequence_and_the_engine_reads_1m_plus_1_blocks(two_blocks: Path, tmp_path: Path) -> None:
    from llmctl.engine.data import RankData, build_source

    out = tmp_path / "prepared"
    # --shard-tokens below one block: each block is read across a shard boundary (a copy, not a memory map)
    args = ["--seq-len", str(MILLION), "--shard-tokens", "1000000", "--workers", "1"]
    code, output = run("data", "prepare", two_blocks, "--out", out, *args)
    assert code == 0, output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["seq_len"] == MILLION and meta["splits"]["train"]["tokens"] == 2 * MILLION + 1
    assert len(meta["splits"]["train"]["shards"]) == 3

    blocks, line = build_source(DataSection(kind="tokens", paths=[str(out)]), MILLION, seed=0, model_vocab=320)
    assert blocks.num_blocks == 2 and f"2 blocks of {MILLION}" in line
    rows = blocks.samples(0, 2)
    assert rows.shape == (2, MILLION + 1) and rows.dtype == np.int64
    whole = np.frombuffer(b"\x00" + two_blocks.read_bytes() + b"\x00", dtype=np.uint8).astype(np.int64)
    whole[0], whole[-1] = 256, 257  # BOS, EOS
    assert {blocks.block_of(0), blocks.block_of(1)} == {0, 1}  # one epoch: each block once, in a seeded order
    for sample, row in enumerate(rows):
        start = blocks.block_of(sample) * MILLION
        assert np.array_equal(row, whole[start : start + MILLION + 1])
    # the engine's micro-batches: inputs and targets of 1M tokens each, the targets shifted by one
    (batch,) = RankData(blocks, micro_batch_size=1, grad_accum_steps=1, dp_rank=0, dp_size=1).micro_batches(0)
    assert tuple(batch.inputs.shape) == tuple(batch.targets.shape) == (1, MILLION)
    assert bool((batch.inputs[0, 1:] == batch.targets[0, :-1]).all())


def test_seq_len_caps_reach_past_1m(tmp_path: Path) -> None:
    """The caps a 1M sequence meets: the CLI's bounds (10M, Llama 4 Scout's context), the plan file's
    training.seq_len (the same limit), and `data prepare`'s own check (one block per split, no upper cap)."""
    assert LIMITS["--seq-len"] >= MILLION
    assert TrainingSection(seq_len=MILLION, max_steps=1).seq_len == MILLION
    src = tmp_path / "small.txt"
    src.write_text("too short for a block", encoding="ascii")
    # "1M" is 1,048,576 tokens, as --seq-len is spelled elsewhere; the refusal is the corpus's size, not a cap
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--seq-len", "1M")
    assert code == 2 and f"less than one block of --seq-len {MILLION} ({MILLION + 1} tokens)" in output
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--seq-len", "20M")
    assert code == 2 and "at most 10,000,000" in output
    assert not (tmp_path / "out").exists()
