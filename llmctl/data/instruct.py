"""`llmctl data prepare --instruction`: chat records -> masked examples -> packs of exactly --seq-len tokens.

    records (llmctl.data.chat: .jsonl lines, .parquet rows, in input order)
      -> one example each: the chat template rendered to token ids, the assistant turns' tokens flagged as loss
      -> the train/val split of each record (the same even spread as plain documents, llmctl.data.job.is_val)
      -> packed greedily, in order: an example joins the current pack if it fits, else the pack is closed (padded
         to S with a padding document: the EOS id, or 0 without one, no loss) and the example starts the next;
         an example longer than S is cut to its first S tokens (counted as truncated)
      -> token shards and flags shards (llmctl.data.format: bit 0 loss, bit 1 document start), meta.json last

An example with no loss token (no assistant turn, or all of its reply cut off by truncation) is dropped and counted.
One process (the chat template is rendered in Python, record by record); --workers is not used.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmctl.data import output
from llmctl.data.chat import DOC_START, LOSS, ChatRenderer, read_records
from llmctl.data.format import FORMAT, VERSION, flags_name
from llmctl.errors import InputError, RuntimeFailure

if TYPE_CHECKING:
    from llmctl.data.job import PrepareConfig, PrepareResult, Progress


class Packer:
    """Greedy packing of one split's examples into packs of exactly `seq_len` tokens, written as they close."""

    def __init__(self, tokens: output.ShardWriter, flags: output.ShardWriter, seq_len: int, pad_id: int) -> None:
        self.tokens, self.flags, self.seq_len, self.pad_id = tokens, flags, seq_len, pad_id
        self._ids: list[np.ndarray] = []
        self._flags: list[np.ndarray] = []
        self._fill = 0
        self.examples = self.truncated = self.dropped = self.loss_tokens = self.packs = 0

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        cut = len(ids) > self.seq_len
        ids, flags = ids[: self.seq_len], flags[: self.seq_len]
        loss = int(np.count_nonzero(flags & LOSS))
        if loss == 0:
            self.dropped += 1
            return
        self.truncated += cut
        if self._fill + len(ids) > self.seq_len:
            self._close()
        self._ids.append(ids)
        self._flags.append(flags)
        self._fill += len(ids)
        self.examples += 1
        self.loss_tokens += loss

    def _close(self) -> None:
        if self._fill == 0:
            return
        pad = self.seq_len - self._fill
        if pad:
            self._ids.append(np.full(pad, self.pad_id, dtype=np.int64))
            self._flags.append(np.concatenate([[DOC_START], np.zeros(pad - 1)]).astype(np.uint8))
        self.tokens.write(np.concatenate(self._ids))
        self.flags.write(np.concatenate(self._flags))
        self.packs += 1
        self._ids, self._flags, self._fill = [], [], 0

    def close(self) -> None:
        self._close()
        self.tokens.documents = self.examples
        self.tokens.close()
        self.flags.close()

    def abort(self) -> None:
        self.tokens.abort()
        self.flags.abort()

    def summary(self) -> dict[str, int]:
        return {
            "seq_len": self.seq_len,
            "examples": self.examples,
            "truncated": self.truncated,
            "dropped": self.dropped,
            "loss_tokens": self.loss_tokens,
        }


def prepare_instruction(cfg: PrepareConfig, on_progress: Callable[[Progress], None] | None = None) -> PrepareResult:
    """Prepare cfg.inputs' chat records into cfg.out (see the module docstring); cfg.seq_len is the pack length."""
    from llmctl.data.job import PrepareResult, Progress, SplitResult, is_val, val_ratio
    from llmctl.data.tokenizer import load_tokenizer, token_dtype

    start = time.perf_counter()
    out = Path(cfg.out)
    if cfg.seq_len is None:
        raise InputError("--instruction needs --seq-len (the length of the packs)")
    seq_len = cfg.seq_len
    records = read_records(cfg.inputs)  # a generator: the inputs are expanded and checked on the first next()
    if cfg.tokenizer is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    tok = load_tokenizer(cfg.tokenizer)
    renderer = ChatRenderer(tok)
    dtype = token_dtype(tok.vocab_size)
    pad_id = tok.eos_id if tok.eos_id is not None else 0
    tmp = output.new_temp(out)
    packers = {
        split: Packer(
            output.ShardWriter(tmp, split, dtype, cfg.shard_tokens),
            output.ShardWriter(tmp, split, np.dtype(np.uint8), cfg.shard_tokens, name=flags_name),
            seq_len,
            pad_id,
        )
        for split in ("train", "val")
    }
    p, q = val_ratio(cfg.val_fraction)
    n = 0
    try:
        for n, rec in enumerate(records, 1):
            ids, flags = renderer.example(rec.where, rec.messages)
            packers["val" if p and is_val(n - 1, p, q) else "train"].add(ids, flags)
            if on_progress is not None and n % 1024 == 0:
                done = sum(x.tokens.tokens for x in packers.values())
                on_progress(Progress(n, done, time.perf_counter() - start, None))
        for packer in packers.values():
            packer.close()
        _check(cfg, packers, n)
        seconds = time.perf_counter() - start
        splits = {
            s: {
                "documents": x.examples,
                "tokens": x.tokens.tokens,
                "shards": x.tokens.shards,
                "flags": x.flags.shards,
                "packed": x.summary(),
            }
            for s, x in packers.items()
        }
        meta: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "tokenizer": {
                "name": tok.name,
                "fingerprint": tok.fingerprint(),
                "bos_id": tok.bos_id,
                "eos_id": tok.eos_id,
            },
            "seq_len": cfg.seq_len,
            "val_fraction": float(cfg.val_fraction),
            "splits": splits,
            "chat_template": renderer.template,
            "sources": _sources(cfg),
            "text_field": None,
            "seconds": round(seconds, 3),
        }
        output.write_meta(tmp, meta)
        output.commit(tmp, out, cfg.force)
    except BaseException as e:
        for packer in packers.values():
            packer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise RuntimeFailure(f"cannot write {out}: {e.strerror or e}") from None
        raise
    tokens = sum(x.tokens.tokens for x in packers.values())
    return PrepareResult(
        out=out,
        documents=n,
        tokens=tokens,
        splits={s: SplitResult(x.examples, x.tokens.tokens, len(x.tokens.shards)) for s, x in packers.items()},
        sources=len(meta["sources"]),
        workers=1,
        seconds=seconds,
        meta=meta,
    )


def _sources(cfg: PrepareConfig) -> list[str]:
    from llmctl.data.sources import expand

    return [str(path) for path, _ in expand(cfg.inputs)]


def _check(cfg: PrepareConfig, packers: dict[str, Packer], records: int) -> None:
    """What only the end of the records can tell, one line each."""
    if records == 0:
        raise InputError(f"no chat records in {', '.join(cfg.inputs)} (every input is empty)")
    train, val = packers["train"], packers["val"]
    if train.packs == 0:
        raise InputError(
            f"none of the {train.dropped} training examples has a loss token (no assistant turn, or it was cut off "
            f"at --seq-len {cfg.seq_len})",
            hint="every example needs an assistant reply inside its first --seq-len tokens",
        )
    if cfg.val_fraction > 0 and val.packs == 0:
        raise InputError(
            f"--val-fraction {cfg.val_fraction} of {records} records gives no validation example",
            hint="raise --val-fraction, or use --val-fraction 0",
        )


def packed_line(meta: dict[str, Any]) -> str | None:
    """One line on the packs of an instruction folder (for the CLI), or None for plain data."""
    parts = []
    for split, e in meta["splits"].items():
        pk = e.get("packed")
        if not pk or not e["tokens"]:
            continue
        packs = e["tokens"] // pk["seq_len"]
        parts.append(
            f"{split} {pk['examples']:,} examples in {packs:,} packs of {pk['seq_len']:,} "
            f"({pk['loss_tokens'] / e['tokens']:.1%} loss tokens, {pk['truncated']} truncated, {pk['dropped']} dropped)"
        )
    return f"packed ({meta.get('chat_template')} chat template): " + "; ".join(parts) if parts else None
