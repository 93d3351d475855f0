"""Instruction (chat) records for `llmctl data prepare --instruction`: read, checked, rendered to tokens with a mask.

A record is one JSON object per line of a .jsonl file (also .jsonl.gz/.bz2/.xz/.zst), or one row of a .parquet
file, in one of four shapes:

    {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}
    {"prompt": str, "response": str}          ("completion" for "response"; an optional "system": str)
    {"instruction": str, "input": str, "output": str}                        (Alpaca; "input" may be empty)
    {"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]}   (ShareGPT)

Rendering: with the tokenizer's own chat template (Hugging Face `apply_chat_template`) when it has one, else
llmctl's plain template (PLAIN_TEMPLATE below; the built-in byte tokenizer always uses it). Only the assistant turns
carry loss. With a chat template the response of turn i is the text between the conversation rendered up to turn i
with the generation prompt (add_generation_prompt=True) and the conversation rendered through turn i: whatever the
template puts around a reply (role headers, end-of-turn tokens) is attributed exactly, end-of-turn included. The text
is tokenized segment by segment (prompt, response, prompt, ...) and concatenated, so no token straddles a boundary.
A template that does not render a conversation's prefixes as prefixes of the whole (one that rewrites earlier
turns) is refused with one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.errors import InputError

ROLES = ("system", "user", "assistant")
PLAIN_TEMPLATE = "llmctl-plain-v1"
"""[BOS] then, per message, "<|{role}|>\\n" + content + "\\n" for system and user turns, and "<|assistant|>\\n" +
content + EOS for assistant turns (the loss covers content + EOS; without an EOS id, content + "\\n")."""

LOSS = 1
"""Flag bit 0: this token is a loss target (predicting it from the previous token counts)."""
DOC_START = 2
"""Flag bit 1: this token starts a document (an example, or a run of padding)."""


@dataclass(frozen=True)
class Record:
    where: str
    """file:line (jsonl) or file:row N (parquet, 0-based): what an error names."""
    messages: list[dict[str, str]]


def _messages(where: str, row: Any) -> list[dict[str, str]]:
    """The conversation of one record, checked: one InputError line naming `where` and the problem."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: a record is a JSON object, not {type(row).__name__}")
    if row.get("messages") is not None:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InputError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                role = m.get("role") if isinstance(m, dict) else type(m).__name__
                raise InputError(f"{where}: messages[{i}] has role {role!r} (expected one of {', '.join(ROLES)})")
            if not isinstance(m.get("content"), str):
                raise InputError(f"{where}: messages[{i}] has no string 'content'")
            out.append({"role": m["role"], "content": m["content"]})
        return out
    if row.get("conversations") is not None:
        return _sharegpt(where, row["conversations"])
    if row.get("instruction") is not None:
        return _alpaca(where, row)
    response = row.get("response", row.get("completion"))
    if not isinstance(row.get("prompt"), str) or not isinstance(response, str):
        raise InputError(
            f"{where}: no 'messages' or 'conversations' list, no 'instruction' and no string 'prompt' with a string "
            "'response' (or 'completion')",
            hint=SHAPES_HINT,
        )
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise InputError(f"{where}: 'system' must be a string")
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": response}]


SHAPES_HINT = (
    "one object per line: {'messages': [...]}, {'prompt': ..., 'response': ...}, Alpaca's {'instruction', 'input', "
    "'output'} or ShareGPT's {'conversations': [{'from', 'value'}]}"
)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
"""ShareGPT's speakers (`from`) as chat roles; `chatgpt`/`bing`/`bard` replies of the original dumps are the
assistant's too (FastChat's conversion keeps them as "gpt")."""
SHAREGPT_ROLES.update({"chatgpt": "assistant", "bing": "assistant", "bard": "assistant"})


def _sharegpt(where: str, turns: Any) -> list[dict[str, str]]:
    """ShareGPT's `conversations`: [{"from": "human" | "gpt" | "system", "value": str}, ...] (the role/content
    spelling some exports use is read too)."""
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} objects")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise InputError(f"{where}: conversations[{i}] is not an object")
        who, text = t.get("from", t.get("role")), t.get("value", t.get("content"))
        role = SHAREGPT_ROLES.get(who) if isinstance(who, str) else None
        if role is None:
            raise InputError(
                f"{where}: conversations[{i}] is from {who!r} (expected one of {', '.join(sorted(SHAREGPT_ROLES))})"
            )
        if not isinstance(text, str):
            raise InputError(f"{where}: conversations[{i}] has no string 'value'")
        out.append({"role": role, "content": text})
    return out


def _alpaca(where: str, row: dict[str, Any]) -> list[dict[str, str]]:
    """Alpaca's {"instruction", "input" (may be empty), "output"}: one user turn (the instruction, then the input
    after a blank line, as Stanford Alpaca's prompt puts it) and the output as the assistant's reply, rendered with
    the tokenizer's chat template like any conversation (not Alpaca's own "### Instruction:" text)."""
    instruction, extra, output = row.get("instruction"), row.get("input", ""), row.get("output")
    if not isinstance(instruction, str) or not isinstance(output, str) or not isinstance(extra, str | None):
        raise InputError(f"{where}: an Alpaca record needs string 'instruction' and 'output' (and 'input' if given)")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    system = row.get("system")
    head = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    return [*head, {"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def _jsonl(path: Path) -> Iterator[Record]:
    from llmctl.data.sources import _decompress_errors, open_stream, stream_error

    try:
        with open_stream(path) as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise InputError(f"{where}: not UTF-8 (byte {e.start} of the line)") from None
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}: not valid JSON ({e.msg})") from None
                except RecursionError:
                    raise InputError(f"{where}: JSON nested too deeply") from None
                yield Record(where, _messages(where, row))
    except (OSError, *_decompress_errors()) as e:
        raise stream_error(path, e) from None


def _parquet(path: Path) -> Iterator[Record]:
    from llmctl.data.sources import BATCH_ROWS, _first_line, _require

    pq = _require("pyarrow.parquet", path, "parquet files")
    row = 0
    try:
        f = pq.ParquetFile(path)
        names = set(f.schema_arrow.names)
        known = ("messages", "conversations", "prompt", "response", "completion", "instruction", "input", "output")
        columns = [c for c in (*known, "system") if c in names]
        if not set(columns) & {"messages", "conversations", "prompt", "instruction"}:
            raise InputError(
                f"{path}: no 'messages', 'conversations', 'prompt' or 'instruction' column (columns: "
                f"{', '.join(sorted(names)[:10])})"
            )
        for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=columns, use_threads=False):
            for r in batch.to_pylist():
                where = f"{path}:row {row}"
                row += 1
                yield Record(where, _messages(where, {k: v for k, v in r.items() if v is not None}))
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read parquet (row {row}: {_first_line(e)})") from None


def read_records(inputs: tuple[str, ...]) -> Iterator[Record]:
    """Every record of the inputs (files and folders, expanded and sorted as `llmctl data prepare` does), in order.
    Only .jsonl and .parquet hold records; any other kind is one line."""
    from llmctl.data.sources import expand

    files = expand(inputs)
    for path, kind in files:
        if kind.name not in ("jsonl", "parquet"):
            raise InputError(
                f"{path}: --instruction reads chat records from .jsonl (also compressed) or .parquet files, not "
                f"{kind.name}",
                hint=SHAPES_HINT,
            )
    for path, kind in files:
        yield from _jsonl(path) if kind.name == "jsonl" else _parquet(path)


class ChatRenderer:
    """Conversations -> (token ids, loss mask) with one tokenizer (llmctl.data.tokenizer's ByteTokenizer or
    HFTokenizer), by its chat template or PLAIN_TEMPLATE."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.templated = bool(getattr(tok, "has_chat_template", False))
        self.template = "tokenizer" if self.templated else PLAIN_TEMPLATE

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text)) if text else []

    def segments(self, where: str, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]:
        """The conversation as (token ids, carries loss) segments, in order."""
        if not self.templated:
            return self._plain(messages)
        render = self.tok.render_chat
        try:
            full = render(messages)
            out: list[tuple[list[int], bool]] = []
            cursor = 0
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                prompt = render(messages[:i], add_generation_prompt=True) if i else ""
                through = render(messages[: i + 1])
                if not (through.startswith(prompt) and full.startswith(through) and len(prompt) >= cursor):
                    raise InputError(
                        f"{where}: the tokenizer's chat template does not render turn {i} as a prefix of the "
                        "conversation (it rewrites earlier turns), so the reply's tokens cannot be told apart",
                        hint="use a tokenizer whose template renders conversations incrementally",
                    )
                out += [(self._ids(full[cursor : len(prompt)]), False), (self._ids(through[len(prompt) :]), True)]
                cursor = len(through)
            out.append((self._ids(full[cursor:]), False))
            return out
        except InputError:
            raise
        except Exception as e:  # jinja's TemplateError (raise_exception in a template), a role it refuses
            raise InputError(
                f"{where}: the chat template refused this conversation ({type(e).__name__}: {e})"
            ) from None

    def _plain(self, messages: list[dict[str, str]]) -> list[tuple[list[int], bool]]:
        tok = self.tok
        out: list[tuple[list[int], bool]] = [([tok.bos_id] if tok.bos_id is not None else [], False)]
        for m in messages:
            if m["role"] == "assistant":
                out.append((self._ids("<|assistant|>\n"), False))
                end = [tok.eos_id] if tok.eos_id is not None else self._ids("\n")
                out.append((self._ids(m["content"]) + end, True))
            else:
                out.append((self._ids(f"<|{m['role']}|>\n{m['content']}\n"), False))
        return out

    def example(self, where: str, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, flags uint8) of one example: DOC_START on its first token, LOSS on the response tokens
        (never on the first token: nothing in the example predicts it)."""
        segs = self.segments(where, messages)
        ids = np.fromiter((t for s, _ in segs for t in s), dtype=np.int64)
        flags = np.concatenate([np.full(len(s), LOSS if loss else 0, dtype=np.uint8) for s, loss in segs])
        if len(flags):
            flags[0] = DOC_START
        return ids, flags
