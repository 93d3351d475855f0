"""`llmctl data prepare`: text, JSON lines, CSV, parquet or Hugging Face datasets -> a prepared token folder.

Only registers the command and renders progress and the result; the work is in llmctl.data.prepare, imported when
the command runs (numpy, pyarrow and the tokenizer stay out of `llmctl --help`).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from llmctl import interrupts
from llmctl.cli.options import length_count

if TYPE_CHECKING:
    from llmctl.data.prepare import PrepareResult, Progress

data_app = typer.Typer(
    name="data",
    help="Prepare training data: tokenize a corpus once, in parallel, into memory-mapped shards.",
    no_args_is_help=True,
)

InputsArg = Annotated[
    list[str],
    typer.Argument(
        help="Files or folders: .txt/.md/.rst (a document per file), .jsonl (per line), .csv (per row), .parquet "
        "(per row), a datasets `save_to_disk` folder (its 'train' split if a DatasetDict); .jsonl/.csv/text also "
        "compressed (.gz .bz2 .xz .zst). Folders are expanded, sorted.",
        show_default=False,
    ),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        help="The prepared folder to create (meta.json + train-*.bin / val-*.bin); written beside it, then renamed.",
        show_default=False,
    ),
]
TokenizerOpt = Annotated[
    Optional[str],
    typer.Option(
        "--tokenizer",
        help="A local Hugging Face tokenizer folder (never downloaded). Default: bytes (0..255, BOS 256, EOS 257).",
        show_default=False,
    ),
]
SeqLenOpt = Annotated[
    Optional[int],
    typer.Option(
        "--seq-len",
        parser=length_count,
        metavar="LEN",
        help="The training sequence length (4096, 128k, 1M = 1,048,576): checks each split holds a block of it "
        "(LEN + 1 tokens), recorded in meta.json.",
        show_default=False,
    ),
]
ValFractionOpt = Annotated[
    float,
    typer.Option("--val-fraction", help="Share of documents in the validation split, in [0, 1) (evenly spread)."),
]
WorkersOpt = Annotated[
    Optional[int],
    typer.Option("--workers", "-j", help="Tokenizer processes. Default: the usable cores.", show_default=False),
]
TextFieldOpt = Annotated[
    str, typer.Option("--text-field", help="The field (jsonl) or column (csv, parquet, datasets) holding the text.")
]
ShardTokensOpt = Annotated[
    int, typer.Option("--shard-tokens", help="The most tokens per shard file (2**28: 512 MiB of uint16).")
]
InstructionOpt = Annotated[
    bool,
    typer.Option(
        "--instruction",
        help="Chat records (.jsonl/.parquet: {messages: [{role, content}]}, {prompt, response}, Alpaca's "
        "{instruction, input, output} or ShareGPT's {conversations: [{from, value}]}): rendered with the "
        "tokenizer's chat template, loss on the assistant turns only, packed whole into sequences of --seq-len.",
    ),
]
GlobOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--glob",
        metavar="PATTERN",
        help="Also read files whose name matches PATTERN as text, a document per file ('*.py'); repeatable.",
        show_default=False,
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace an existing prepared --out (only once the new one is complete).")
]


@data_app.command("prepare")
def prepare(
    inputs: InputsArg,
    out: OutOpt,
    tokenizer: TokenizerOpt = None,
    seq_len: SeqLenOpt = None,
    val_fraction: ValFractionOpt = 0.0,
    workers: WorkersOpt = None,
    text_field: TextFieldOpt = "text",
    shard_tokens: ShardTokensOpt = 2**28,
    force: ForceOpt = False,
    instruction: InstructionOpt = False,
    glob: GlobOpt = None,
) -> None:
    """Tokenize a corpus once (streaming, in parallel) into train/val shards that `data.kind: tokens` trains on."""
    from llmctl.data.job import usable_cores
    from llmctl.data.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(
        inputs=tuple(inputs),
        out=out,
        tokenizer=tokenizer,
        seq_len=seq_len,
        val_fraction=val_fraction,
        workers=usable_cores() if workers is None else workers,
        text_field=text_field,
        shard_tokens=shard_tokens,
        force=force,
        instruction=instruction,
        text_globs=tuple(glob or ()),
    )
    # SIGTERM and SIGHUP unwind like Ctrl-C: the workers stop, the temporary folder goes, one line, exit 128 + N.
    with interrupts.raise_on(signal.SIGTERM, signal.SIGHUP), _ProgressBar() as on_progress:
        result = prepare(cfg, on_progress)
    typer.echo(summary_line(result))
    if instruction:
        from llmctl.data.instruct import packed_line

        typer.echo(packed_line(result.meta))


class _ProgressBar:
    """A rich progress bar on stderr when it is a terminal (documents, tokens, tokens/s); else nothing, the summary
    line says it all at the end (a log file gets no bar redrawn thousands of times)."""

    def __enter__(self) -> Any:
        self._bar: Any = None
        if not sys.stderr.isatty():
            return None
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("tokenizing"),
            BarColumn(),
            TextColumn("{task.completed:,}{task.fields[of]} docs"),
            TextColumn("{task.fields[tokens]:,} tokens"),
            TextColumn("{task.fields[rate]} tokens/s"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task("prepare", total=None, of="", tokens=0, rate="-")
        return self.update

    def update(self, p: Progress) -> None:
        self._bar.update(
            self._task,
            completed=p.documents,
            total=p.total_documents,
            of=f"/{p.total_documents:,}" if p.total_documents else "",
            tokens=p.tokens,
            rate=_si(p.tokens / p.seconds) if p.seconds > 0 else "-",
        )

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def summary_line(r: PrepareResult) -> str:
    def split(name: str) -> str:
        s = r.splits[name]
        return f"{name} {s.documents:,} docs / {s.tokens:,} tokens in {s.shards} shard{'s' if s.shards != 1 else ''}"

    return (
        f"prepared {r.out}: {r.documents:,} documents, {r.tokens:,} tokens ({split('train')}; {split('val')}), "
        f"{r.meta['dtype']}, {_si(r.tokens_per_s)} tokens/s, {r.seconds:.1f} s, {r.workers} "
        f"worker{'s' if r.workers != 1 else ''}"
    )


def register(app: typer.Typer) -> None:
    # The parent's group class: its error mapping, and the numeric bounds (llmctl.bounds) on `prepare`'s options.
    app.add_typer(data_app, name="data", cls=app.info.cls)
