"""`llmctl data prepare`: documents -> [BOS] doc [EOS] token stream -> train / val shards (llmctl.data.format).

The pipeline, one pass and streaming (memory bounded by a few batches per worker, never by the corpus):

    sources (llmctl.data.sources, read in this process, in order)
      -> batches of documents (at most BATCH_DOCS documents / BATCH_CHARS characters, numbered from 0)
      -> worker processes: the fast tokenizer's batch call, framing, the train/val split of each document
      -> results taken back in submission order (at most WINDOW_PER_WORKER batches in flight per worker)
      -> appended to the split's current shard in a hidden temporary folder beside --out
      -> meta.json written last, the folder renamed to --out (a replaced --out is removed only after that)

The output depends only on the inputs, the tokenizer and the options, never on --workers or the batch sizes: each
document is tokenized on its own, and results are written in document order.

Validation split (by document, streaming): llmctl.data.job.is_val, an even spread of exactly floor(nF) documents.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from llmctl.data import output
from llmctl.data.format import FORMAT, VERSION
from llmctl.data.job import PrepareConfig, PrepareResult, Progress, SplitResult, is_val, val_ratio
from llmctl.data.sources import Source, open_sources
from llmctl.errors import InputError, LlmctlError, RuntimeFailure
from llmctl.interrupts import exit_with

BATCH_DOCS = 1024
BATCH_CHARS = 2**19
"""A batch of documents sent to a worker: ~0.5 MB of text, a fraction of a second of tokenizing, so that the
workers stay evenly loaded and the progress bar moves; per-batch overhead (pickling, a pipe) stays below 1%."""
WINDOW_PER_WORKER = 3
"""Batches in flight per worker: enough that a worker never waits for the reader, and what bounds memory."""


# --- the workers -----------------------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str | None, p: int, q: int, parent: int) -> None:
    """Once per worker process: its own tokenizer (one Rust thread: the processes are the parallelism). A tokenizer
    that does not load is kept as the worker's error, said by its first job (an initializer that raises would make
    the pool restart workers forever). The worker ends when the command (`parent`) does, even by SIGKILL: a worker
    whose parent is gone would wait forever on its queue (its parent is the forkserver, not the command)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it stops the pool)
    exit_with(parent)
    from llmctl.data.tokenizer import load_tokenizer, token_dtype

    try:
        if tokenizer is not None:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()  # "longer than model_max_length": documents are not model inputs
        tok = load_tokenizer(tokenizer)
    except LlmctlError as e:
        _WORKER["error"] = (e.message.replace("data.tokenizer: ", "--tokenizer: "), e.hint)
        return
    except ImportError as e:
        _WORKER["error"] = (f"--tokenizer needs {e.name or 'transformers'}", "pip install 'llmctl[train]'")
        return
    _WORKER.update(tok=tok, dtype=token_dtype(tok.vocab_size), p=p, q=q)


@dataclass(frozen=True)
class TokenizerInfo:
    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    fingerprint: str


def _describe(_: object = None) -> TokenizerInfo | tuple[str, str | None]:
    """The worker's tokenizer (the parent never loads it: transformers costs seconds to import), or its error."""
    if "error" in _WORKER:
        return _WORKER["error"]
    tok = _WORKER["tok"]
    return TokenizerInfo(tok.name, tok.vocab_size, tok.bos_id, tok.eos_id, tok.fingerprint())


def frame(ids: Sequence[Sequence[int]], bos: int | None, eos: int | None, dtype: np.dtype) -> np.ndarray:
    """[BOS] doc [EOS] for each document, concatenated (as the engine frames `data.kind: text` documents)."""
    head = (bos,) if bos is not None else ()
    tail = (eos,) if eos is not None else ()
    count = sum(map(len, ids)) + (len(head) + len(tail)) * len(ids)
    return np.fromiter(chain.from_iterable(x for doc in ids for x in (head, doc, tail)), dtype=dtype, count=count)


def _encode(job: tuple[int, list[str]]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(train tokens, val tokens, train documents, val documents) of one batch whose first document has the global
    index `first`."""
    first, texts = job
    if "error" in _WORKER:
        raise InputError(*_WORKER["error"])
    tok, dtype, p, q = _WORKER["tok"], _WORKER["dtype"], _WORKER["p"], _WORKER["q"]
    ids = tok.encode_batch(texts)
    val = [is_val(first + k, p, q) for k in range(len(ids))] if p else [False] * len(ids)
    train_ids = [d for d, v in zip(ids, val) if not v]
    val_ids = [d for d, v in zip(ids, val) if v]
    return (
        frame(train_ids, tok.bos_id, tok.eos_id, dtype),
        frame(val_ids, tok.bos_id, tok.eos_id, dtype),
        len(train_ids),
        len(val_ids),
    )


def _pool(cfg: PrepareConfig) -> Executor:
    """Worker processes from a fresh forkserver: no thread state of this process (a progress bar, a Rust tokenizer's
    thread pool, pyarrow's) is forked; the server preloads the imports once, each worker forks from it warm."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("forkserver")
    preload = [__name__, "llmctl.data.tokenizer"]
    if cfg.tokenizer is not None:
        preload.append("transformers.models.auto.tokenization_auto")  # seconds of imports, paid once
    ctx.set_forkserver_preload(preload)  # a no-op when this process already started its forkserver
    p, q = val_ratio(cfg.val_fraction)
    return ProcessPoolExecutor(
        cfg.workers, mp_context=ctx, initializer=_init_worker, initargs=(cfg.tokenizer, p, q, os.getpid())
    )


def _in_order(pool: Executor, jobs: Iterable[Any], fn: Callable[[Any], Any], window: int) -> Iterator[Any]:
    """pool.map in submission order with at most `window` jobs submitted ahead (Executor.map and Pool.imap read
    the whole input first: the whole corpus in memory when reading outpaces tokenizing)."""
    pending: deque[Future[Any]] = deque()
    for job in jobs:
        pending.append(pool.submit(fn, job))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def batches(
    sources: Iterable[Source], max_docs: int | None = None, max_chars: int | None = None
) -> Iterator[tuple[int, list[str]]]:
    """(index of the first document, documents) in order; batches span source boundaries."""
    max_docs = max_docs or BATCH_DOCS
    max_chars = max_chars or BATCH_CHARS
    batch: list[str] = []
    chars = first = 0
    for doc in chain.from_iterable(s.documents() for s in sources):
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= max_docs or chars >= max_chars:
            yield first, batch
            first += len(batch)
            batch, chars = [], 0
    if batch:
        yield first, batch


# --- the whole command -----------------------------------------------------------------------------------------
def _check_splits(cfg: PrepareConfig, train: output.ShardWriter, val: output.ShardWriter, documents: int) -> None:
    """The checks only the end of the stream can make, as one line each."""
    if documents == 0:
        raise InputError(f"no documents in {', '.join(cfg.inputs)} (every input is empty)")
    if train.tokens == 0:
        raise InputError(f"the {documents} documents hold no tokens (all empty, and the tokenizer has no BOS/EOS)")
    if cfg.val_fraction > 0 and val.documents == 0:
        p, q = val_ratio(cfg.val_fraction)
        raise InputError(
            f"--val-fraction {cfg.val_fraction} of {documents} document{'s' if documents != 1 else ''} gives no "
            f"validation document "
            f"(it takes at least {math.ceil(q / p)} documents)",
            hint="raise --val-fraction, or use --val-fraction 0 and separate validation files",
        )
    if cfg.seq_len is not None:
        for w in (train, val) if cfg.val_fraction > 0 else (train,):
            if w.tokens < cfg.seq_len + 1:
                hint = "raise --val-fraction or lower --seq-len" if w is val else "use more text or a lower --seq-len"
                raise InputError(
                    f"the {w.split} split has {w.tokens} tokens, less than one block of --seq-len {cfg.seq_len} "
                    f"({cfg.seq_len + 1} tokens)",
                    hint=hint,
                )


def prepare(cfg: PrepareConfig, on_progress: Callable[[Progress], None] | None = None) -> PrepareResult:
    """Tokenize cfg.inputs into the prepared folder cfg.out (see the module docstring). Raises InputError (one line)
    for bad input; on any failure or interrupt, nothing is left at cfg.out that was not there before."""
    start = time.perf_counter()
    out = Path(cfg.out)
    output.check_out(out, cfg.force)
    if out.parent.exists() and not out.parent.is_dir():
        raise InputError(f"{out.parent} is not a folder (the parent of --out)")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_dir():
        raise InputError(
            f"--tokenizer: {cfg.tokenizer!r} is not a folder", hint="a local Hugging Face tokenizer folder"
        )
    if cfg.instruction:
        from llmctl.data.instruct import prepare_instruction

        return prepare_instruction(cfg, on_progress)
    sources = open_sources(cfg.inputs, cfg.text_field, cfg.text_globs)  # every input checked before any process starts
    pool = _pool(cfg)
    try:
        described = pool.submit(_describe).result()
        if not isinstance(described, TokenizerInfo):
            raise InputError(*described)
        return _run(cfg, pool, sources, described, start, on_progress)
    except BrokenProcessPool as e:
        raise RuntimeFailure(
            f"a tokenizer worker process died ({e})", hint="out of memory? try fewer --workers"
        ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # an error or Ctrl-C: drop the batches not started


def _run(
    cfg: PrepareConfig,
    pool: Executor,
    sources: list[Source],
    tok: TokenizerInfo,
    start: float,
    on_progress: Callable[[Progress], None] | None,
) -> PrepareResult:
    from llmctl.data.tokenizer import token_dtype

    out = Path(cfg.out)
    counts = [s.num_documents for s in sources]
    total_docs = None if None in counts else sum(c for c in counts if c is not None)
    dtype = token_dtype(tok.vocab_size)
    tmp = output.new_temp(out)
    train = output.ShardWriter(tmp, "train", dtype, cfg.shard_tokens)
    val = output.ShardWriter(tmp, "val", dtype, cfg.shard_tokens)
    documents = tokens = 0
    try:
        window = WINDOW_PER_WORKER * cfg.workers
        for train_tokens, val_tokens, train_docs, val_docs in _in_order(pool, batches(sources), _encode, window):
            train.write(train_tokens)
            val.write(val_tokens)
            train.documents += train_docs
            val.documents += val_docs
            documents += train_docs + val_docs
            tokens += train_tokens.size + val_tokens.size
            if on_progress is not None:
                on_progress(Progress(documents, tokens, time.perf_counter() - start, total_docs))
        train.close()
        val.close()
        _check_splits(cfg, train, val, documents)
        seconds = time.perf_counter() - start
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "vocab_size": tok.vocab_size,
            "tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint, "bos_id": tok.bos_id, "eos_id": tok.eos_id},
            "seq_len": cfg.seq_len,
            "val_fraction": float(cfg.val_fraction),
            "splits": {
                w.split: {"documents": w.documents, "tokens": w.tokens, "shards": w.shards} for w in (train, val)
            },
            "sources": [str(s.path) for s in sources],
            "text_field": cfg.text_field,
            "seconds": round(seconds, 3),
        }
        output.write_meta(tmp, meta)  # last: its presence marks the folder complete
        output.commit(tmp, out, cfg.force)
    except BaseException as e:
        train.abort()
        val.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a quota, a folder removed under us: one line, not a traceback
            raise RuntimeFailure(f"cannot write {out}: {e.strerror or e}") from None
        raise
    return PrepareResult(
        out=out,
        documents=documents,
        tokens=tokens,
        splits={w.split: SplitResult(w.documents, w.tokens, len(w.shards)) for w in (train, val)},
        sources=len(sources),
        workers=cfg.workers,
        seconds=seconds,
        meta=meta,
    )
