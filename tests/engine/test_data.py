"""Data: byte tokenizer, packing, seeded order, per-rank slices; `data.kind: tokens` reads only prepared folders."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from llmctl.data.tokenizer import ByteTokenizer
from llmctl.engine.data import PackedBlocks, RankData, SyntheticBlocks, build_source, build_val_source, tokenize
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


def _old_token_file(folder: Path) -> Path:
    """A token file in the older single-file format (its build command is gone): raw tokens + FILE.bin.json."""
    out = folder / "corpus.bin"
    np.asarray([256, 104, 105, 257], dtype="<u2").tofile(out)
    meta = {"format": "llmctl-tokens", "version": 1, "dtype": "uint16", "num_tokens": 4, "vocab_size": 258}
    (folder / "corpus.bin.json").write_text(json.dumps(meta))
    return out


def test_a_single_token_file_is_refused_with_one_line_naming_prepare(tmp_path: Path) -> None:
    """The old single-file format is not read: one line that names the file and the command that replaces it."""
    old = _old_token_file(tmp_path)
    with pytest.raises(InputError) as e:
        build_source(DataSection(kind="tokens", paths=[str(old)]), 4, 0, 320)
    line = str(e.value)
    assert "\n" not in line and f"data.paths: {old} is a single .bin token file" in line, line
    assert "`llmctl data prepare`" in line and "llmctl data prepare TEXT... --out FOLDER" in line, line
    val = DataSection(kind="tokens", paths=[str(tmp_path)], val=[str(old)])
    with pytest.raises(InputError, match=re.escape(f"data.val: {old} is a single .bin token file")):
        build_val_source(val, 4, 320)
    with pytest.raises(InputError, match="is a file; data.kind tokens reads a folder made by `llmctl data prepare`"):
        build_source(DataSection(kind="tokens", paths=[str(CORPUS / "stdlib-docstrings.txt")]), 4, 0, 320)


@pytest.mark.parametrize(
    ("kind", "paths", "needle"),
    [
        ("text", ["/no/such/file.txt"], "does not exist"),
        ("tokens", ["/no/such.bin"], "does not exist; expected a folder made by `llmctl data prepare`"),
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
