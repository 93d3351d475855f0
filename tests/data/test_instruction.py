"""`llmctl data prepare --instruction`: the loss mask covers the assistant turns only (a Hugging Face chat template
and llmctl's plain template), examples are packed whole into sequences of exactly --seq-len with document-start
flags, truncation and drops are counted, and a bad record is one line naming file:line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_helpers import run

from llmctl.data.chat import DOC_START, LOSS
from llmctl.data.format import open_flags, open_prepared
from llmctl.errors import InputError

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""A small chat template in the shape of the common ones: a role header, the content, an end-of-turn token."""

CHATS = [
    {"messages": [{"role": "user", "content": "What is FSDP?"}, {"role": "assistant", "content": "Sharding."}]},
    {"prompt": "2+2?", "response": "four", "system": "Be brief."},
    {
        "messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Colour of the sky?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And grass?"},
            {"role": "assistant", "content": "Green."},
        ]
    },
    {"prompt": "Name a prime.", "completion": "seven"},
]


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(out: Path, split: str = "train") -> tuple[np.ndarray, np.ndarray, dict]:
    tokens, meta = open_prepared(out, split)
    flags, packed = open_flags(out, split, meta)
    return tokens[:].astype(np.int64), flags[:], packed


def documents(tokens: np.ndarray, flags: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    starts = list(np.flatnonzero(flags & DOC_START)) + [len(tokens)]
    return [(tokens[a:b], flags[a:b]) for a, b in zip(starts, starts[1:])]


def replies(chat: dict) -> list[str]:
    if "messages" in chat:
        return [m["content"] for m in chat["messages"] if m["role"] == "assistant"]
    return [chat.get("response", chat.get("completion"))]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE tokenizer (every byte in its alphabet, no prefix space, as Llama 3's) with TEMPLATE as its
    chat template, trained here on generated text (no download)."""
    from data_helpers import make_docs
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(make_docs(300, seed=7) + [json.dumps(c) for c in CHATS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("chat-tok")
    fast.save_pretrained(folder)
    return str(folder)


def test_only_the_assistant_turns_carry_loss_with_a_chat_template(tmp_path: Path, chat_tokenizer: str) -> None:
    from transformers import AutoTokenizer

    src = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    code, output = run(
        "data", "prepare", src, "--out", tmp_path / "out", "--instruction", "--seq-len", "512",
        "--tokenizer", chat_tokenizer,
    )  # fmt: skip
    assert code == 0, output
    assert "packed (tokenizer chat template): train 4 examples in 1 packs of 512" in output
    tokens, flags, packed = read(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    docs = documents(tokens, flags)
    assert len(docs) == 5  # the four examples and the padding
    for chat, (ids, f) in zip(CHATS, docs):
        text = tok.decode(ids)
        msgs = chat.get("messages") or [
            *([{"role": "system", "content": chat["system"]}] if "system" in chat else []),
            {"role": "user", "content": chat["prompt"]},
            {"role": "assistant", "content": replies(chat)[0]},
        ]
        assert text == tok.apply_chat_template(msgs, tokenize=False)  # segment-wise tokenizing loses nothing
        loss_text = tok.decode(ids[(f & LOSS) != 0])
        # exactly the replies, each with its end-of-turn ("</s>\n"); no header, no prompt, no system text
        assert loss_text == "".join(f"{r}</s>\n" for r in replies(chat)), loss_text
    pad_ids, pad_flags = docs[4]
    assert not (pad_flags & LOSS).any() and (pad_ids == tok.eos_token_id).all()
    assert packed["loss_tokens"] == int(np.count_nonzero(flags & LOSS)) and packed["examples"] == 4


def test_the_byte_tokenizer_uses_the_plain_template(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", CHATS[:2])
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--instruction", "--seq-len", "256")
    assert code == 0, output
    tokens, flags, _ = read(tmp_path / "out")
    (a, fa), (b, fb), _pad = documents(tokens, flags)
    assert a[0] == 256 and bytes(a[1:-1].tolist()).decode() == "<|user|>\nWhat is FSDP?\n<|assistant|>\nSharding."
    assert list(a[(fa & LOSS) != 0]) == [*b"Sharding.", 257]  # the reply and EOS
    assert bytes(b[1:-1].tolist()).decode() == "<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\nfour"
    assert list(b[(fb & LOSS) != 0]) == [*b"four", 257]


def test_packing_is_greedy_in_order_with_truncation_and_drops_counted(tmp_path: Path) -> None:
    """Plain template, byte tokens: an example is 26 + len(prompt) + len(reply) tokens (BOS, "<|user|>\\n", prompt,
    "\\n", "<|assistant|>\\n", reply, EOS). Packs of 64: [30, 30 | pad 4], [40 | pad 24], [64 cut from 100]; an
    example with no reply and one whose reply lies past token 64 are dropped."""

    def ex(prompt: int, reply: int) -> dict:
        return {"prompt": "p" * prompt, "response": "r" * reply}

    rows = [ex(2, 2), ex(2, 2), {"messages": [{"role": "user", "content": "hi"}]}, ex(10, 4), ex(10, 64), ex(60, 5)]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--instruction", "--seq-len", "64")
    assert code == 0, output
    tokens, flags, packed = read(tmp_path / "out")
    assert len(tokens) == 3 * 64
    starts = np.flatnonzero(flags & DOC_START)
    assert list(starts) == [0, 30, 60, 64, 104, 128]  # examples and padding runs; every pack starts one
    assert (tokens[60:64] == 257).all() and (tokens[104:128] == 257).all()  # padding: EOS, no loss
    assert not (flags[60:64] & LOSS).any() and not (flags[104:128] & LOSS).any()
    assert packed == {"seq_len": 64, "examples": 4, "truncated": 1, "dropped": 2, "loss_tokens": 3 + 3 + 5 + 29}
    assert int(np.count_nonzero(flags & LOSS)) == packed["loss_tokens"]
    assert not (flags[starts] & LOSS).any()  # a document's first token is never a target
    assert "train 4 examples in 3 packs of 64 (20.8% loss tokens, 1 truncated, 2 dropped)" in output


def test_val_split_takes_whole_examples(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(10)]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    code, output = run(
        "data", "prepare", src, "--out", tmp_path / "out", "--instruction", "--seq-len", "64",
        "--val-fraction", "0.2",
    )  # fmt: skip
    assert code == 0, output
    tokens, flags, packed = read(tmp_path / "out", "val")
    assert packed["examples"] == 2
    texts = [bytes(t[(f & LOSS) != 0][:-1].tolist()).decode() for t, f in documents(tokens, flags) if (f & LOSS).any()]
    assert texts == ["a4", "a9"]  # records 4 and 9: one every 1/F, as plain documents split
    assert read(tmp_path / "out")[2]["examples"] == 8


def test_parquet_records(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["x", "y"]}), tmp_path / "in.parquet")
    code, output = run(
        "data", "prepare", tmp_path / "in.parquet", "--out", tmp_path / "o", "--instruction", "--seq-len", "64"
    )
    assert code == 0, output
    tokens, flags, packed = read(tmp_path / "o")
    assert packed["examples"] == 2 and list(tokens[(flags & LOSS) != 0]) == [ord("x"), 257, ord("y"), 257]


def test_parquet_messages_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "in.parquet")
    code, output = run(
        "data", "prepare", tmp_path / "in.parquet", "--out", tmp_path / "o", "--instruction", "--seq-len", "64"
    )
    assert code == 0, output
    tokens, flags, _ = read(tmp_path / "o")
    assert list(tokens[(flags & LOSS) != 0]) == [*b"yo", 257]
    bad = pa.table({"messages": [[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "x"}]]})
    pq.write_table(bad, tmp_path / "bad.parquet")
    code, output = run(
        "data", "prepare", tmp_path / "bad.parquet", "--out", tmp_path / "b", "--instruction", "--seq-len", "64"
    )
    assert code == 2 and f"{tmp_path / 'bad.parquet'}:row 1: messages[0] has role 'robot'" in output, output


def test_a_damaged_flags_stream_is_one_line(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    assert run("data", "prepare", src, "--out", tmp_path / "o", "--instruction", "--seq-len", "128")[0] == 0
    _, meta = open_prepared(tmp_path / "o")
    (tmp_path / "o" / "train-00000.flags.bin").write_bytes(b"\0" * 5)
    with pytest.raises(InputError, match=r"shard train-00000.flags.bin has 5 bytes; its metadata says"):
        open_flags(tmp_path / "o", "train", meta)
    meta["splits"]["train"]["packed"]["seq_len"] = 100
    with pytest.raises(InputError, match="not whole packs of 100"):
        open_flags(tmp_path / "o", "train", meta)


def test_a_plain_folder_has_no_flags(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("plain text")
    assert run("data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "o")[0] == 0
    _, meta = open_prepared(tmp_path / "o")
    assert open_flags(tmp_path / "o", "train", meta) is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"prompt": "a"}',
            "chat.jsonl:2: no 'messages' or 'conversations' list, no 'instruction' and no string 'prompt' with a string 'response'",
        ),
        ('{"messages": []}', "chat.jsonl:2: 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "chat.jsonl:2: messages[0] has role 'bot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "chat.jsonl:2: messages[0] has no string 'content'"),
        ('{"prompt": "a", "response": "b", "system": 1}', "chat.jsonl:2: 'system' must be a string"),
        ("[1, 2]", "chat.jsonl:2: a record is a JSON object, not list"),
        ("{not json", "chat.jsonl:2: not valid JSON"),
    ],
)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps(CHATS[1]) + "\n" + line + "\n")
    before = sorted(tmp_path.rglob("*"))
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", "--instruction", "--seq-len", "64")
    lines = output.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("llmctl: error: "), output
    assert message in lines[0], lines[0]
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--instruction"], "--instruction needs --seq-len"),
        (["--instruction", "--seq-len", "64", "--val-fraction", "0.5"], "gives no validation example"),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    src = write_jsonl(tmp_path / "chat.jsonl", CHATS[:1])
    code, output = run("data", "prepare", src, "--out", tmp_path / "out", *args)
    assert code == 2 and len(output.strip().splitlines()) == 1 and message in output, output


def test_a_text_file_is_refused_in_instruction_mode(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text")
    code, output = run(
        "data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "o", "--instruction", "--seq-len", "8"
    )
    assert (
        code == 2
        and "--instruction reads chat records from .jsonl (also compressed) or .parquet files, not text" in output
    ), output


def test_plan_data_names_the_pack_length(tmp_path: Path) -> None:
    from llmctl.data.check import plan_data

    src = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    assert run("data", "prepare", src, "--out", tmp_path / "o", "--instruction", "--seq-len", "128")[0] == 0
    section, line = plan_data([str(tmp_path / "o")], 320)
    assert (
        section["kind"] == "tokens" and "4 examples packed in sequences of 128 (training.seq_len must be 128)" in line
    )


def test_a_template_that_does_not_render_prefixes_is_refused(tmp_path: Path, chat_tokenizer: str) -> None:
    """A generation prompt the rendered reply does not start with: the reply's tokens cannot be told apart."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    src = write_jsonl(tmp_path / "chat.jsonl", CHATS[:1])
    code, output = run(
        "data",
        "prepare",
        src,
        "--out",
        tmp_path / "o",
        "--instruction",
        "--seq-len",
        "64",
        "--tokenizer",
        tmp_path / "tok",
    )
    assert code == 2 and len(output.strip().splitlines()) == 1, output
    assert "chat.jsonl:1: the tokenizer's chat template does not render turn 1 as a prefix" in output, output
