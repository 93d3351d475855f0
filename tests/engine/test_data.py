"""Data: byte tokenizer, packing, seeded order, per-rank slices, the memory-mapped token format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llmctl.engine.data import (
    ByteTokenizer,
    PackedBlocks,
    RankData,
    SyntheticBlocks,
    build_main,
    build_source,
    open_token_file,
    tokenize,
)
from llmctl.errors import InputError
from llmctl.spec.planfile import DataSection

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "corpus"


def test_byte_tokenizer_frames_documents() -> None:
    t = tokenize(["hi", "é"], ByteTokenizer())
    assert t.tolist() == [256, 104, 105, 257, 256, 0xC3, 0xA9, 257] and t.dtype == np.uint16


def test_blocks_are_next_token_pairs_and_cover_an_epoch() -> None:
    tokens = np.arange(1001, dtype=np.uint16)
    blocks = PackedBlocks(tokens, seq_len=10, seed=3)
    assert blocks.num_blocks == 100
    s = blocks.samples(0, 100)
    assert s.shape == (100, 11)
    assert sorted(s[:, 0].tolist()) == list(range(0, 1000, 10))  # every block once per epoch
    assert (s[:, 1:] == s[:, :-1] + 1).all()  # targets are the next tokens
    # the next epoch is another permutation of the same blocks
    e2 = blocks.samples(100, 100)
    assert sorted(e2[:, 0].tolist()) == sorted(s[:, 0].tolist()) and e2[:, 0].tolist() != s[:, 0].tolist()


def test_order_is_deterministic_for_a_seed() -> None:
    tokens = np.arange(5000, dtype=np.uint16)
    a, b, c = (PackedBlocks(tokens, 16, seed).samples(7, 20) for seed in (1, 1, 2))
    assert (a == b).all() and not (a == c).all()


def test_ranks_read_disjoint_parts_and_accumulation_sees_the_same_samples() -> None:
    blocks = PackedBlocks(np.arange(20000, dtype=np.uint16), 16, seed=0)
    r0 = RankData(blocks, micro_batch_size=2, grad_accum_steps=1, dp_rank=0, dp_size=2).micro_batches(3)
    r1 = RankData(blocks, micro_batch_size=2, grad_accum_steps=1, dp_rank=1, dp_size=2).micro_batches(3)
    acc = RankData(blocks, micro_batch_size=1, grad_accum_steps=2, dp_rank=0, dp_size=2).micro_batches(3)
    assert len(r0) == 1 and len(acc) == 2
    assert not set(r0[0].inputs[:, 0].tolist()) & set(r1[0].inputs[:, 0].tolist())
    both = np.concatenate([m.inputs.numpy() for m in acc])
    assert (both == r0[0].inputs.numpy()).all()
    assert r0[0].inputs.shape == (2, 16) and r0[0].targets.shape == (2, 16)


def test_synthetic_is_seeded_and_in_vocab() -> None:
    s = SyntheticBlocks(320, 32, 0)
    assert (s.samples(5, 3) == s.samples(5, 3)).all() and s.samples(0, 4).max() < 320


def test_build_token_file_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": "world"}) + "\n")
    out = tmp_path / "out" / "corpus.bin"
    assert build_main(["build", "--out", str(out), str(docs)]) == 0
    assert "wrote" in capsys.readouterr().out
    tokens, meta = open_token_file(out)
    assert meta["num_tokens"] == 14 and meta["dtype"] == "uint16"
    assert bytes(tokens[1:6].tolist()) == b"hello" and tokens[0] == 256 and tokens[6] == 257
    blocks, desc = build_source(DataSection(kind="tokens", paths=[str(out)]), 4, 0, 320)
    assert blocks.num_blocks == 3 and "14 tokens" in desc


def test_text_source_matches_token_file(tmp_path: Path) -> None:
    out = tmp_path / "c.bin"
    assert build_main(["build", "--out", str(out), str(CORPUS)]) == 0
    a, _ = build_source(DataSection(kind="text", paths=[str(CORPUS)]), 64, 0, 320)
    b, _ = build_source(DataSection(kind="tokens", paths=[str(out)]), 64, 0, 320)
    assert (a.samples(0, 8) == b.samples(0, 8)).all()


@pytest.mark.parametrize(
    ("kind", "paths", "needle"),
    [
        ("text", ["/no/such/file.txt"], "does not exist"),
        ("tokens", ["/no/such.bin"], "not a token file"),
        ("tokens", [], "exactly one"),
    ],
)
def test_bad_data_is_one_clear_line(kind: str, paths: list[str], needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        build_source(DataSection.model_construct(kind=kind, paths=paths, val=None), 64, 0, 320)


def test_tokenizer_bigger_than_model_vocab() -> None:
    with pytest.raises(InputError, match="vocabulary is 128"):
        build_source(DataSection(kind="text", paths=[str(CORPUS)]), 64, 0, 128)


def test_bad_jsonl(tmp_path: Path) -> None:
    f = tmp_path / "x.jsonl"
    f.write_text('{"body": "a"}\n')
    with pytest.raises(InputError, match="x.jsonl:1: no string field 'text'"):
        build_source(DataSection(kind="text", paths=[str(f)]), 4, 0, 320)
    assert build_main(["build", "--out", str(tmp_path / "o.bin"), str(f)]) == 2


def _train_tokenizer(folder: Path) -> Path:
    """A 300-token byte-level BPE tokenizer trained on the shipped corpus, saved to `folder` (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train(
        [str(CORPUS / "stdlib-docstrings.txt")],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


def test_local_hf_tokenizer_folder(tmp_path: Path) -> None:
    """A tokenizer from a local folder (built here from the corpus: nothing is downloaded)."""
    _train_tokenizer(tmp_path / "tok")
    blocks, desc = build_source(
        DataSection(kind="text", paths=[str(CORPUS)], tokenizer=str(tmp_path / "tok")), 32, 0, 320
    )
    assert "tok" in desc and blocks.samples(0, 2).max() < 300
    assert int(blocks.tokens[0]) == 1  # <s> opens the first document
    with pytest.raises(InputError, match="data.tokenizer"):
        build_source(
            DataSection(kind="text", paths=[str(CORPUS)], tokenizer=str(tmp_path / "nothing-here")), 32, 0, 320
        )


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ("", "empty token-file metadata"),
        ("{bad", "is not valid JSON"),
        ("[1, 2]", "malformed token metadata"),
        ('{"dtype": "nope", "num_tokens": 4}', "malformed token metadata"),
        ('{"dtype": "uint16", "num_tokens": "x"}', "malformed token metadata"),
        ('{"dtype": "uint16", "num_tokens": 5}', "size does not match its metadata"),
    ],
)
def test_bad_token_metadata_is_one_input_error(tmp_path: Path, meta: str, message: str) -> None:
    from llmctl.engine.data import open_token_file
    from llmctl.errors import InputError

    (tmp_path / "t.bin").write_bytes(b"\0" * 8)
    (tmp_path / "t.bin.json").write_text(meta)
    with pytest.raises(InputError, match=message):
        open_token_file(tmp_path / "t.bin")
