"""Options shared by several commands, defined once as Annotated aliases (huggingface_hub's CLI style)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Optional

import typer

# --- sizes with suffixes ---------------------------------------------------------------------------------------------
# Lengths in tokens (--seq-len, --loss-chunk) are powers of two in practice and spelled in binary thousands: "128k"
# context is 131,072 tokens (Llama 3.1's config.json max_position_embeddings; Qwen2.5's 32k is 32,768). Counts
# (--tokens, --global-batch, --global-batch-tokens) are decimal, as token budgets are published ("2T tokens" =
# 2 x 10^12; llmctl.spec.models.parse_count).
_LENGTH = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kKmM]?)\s*")
_LENGTH_UNIT = {"": 1, "K": 1024, "M": 1024**2}


_DECIMAL = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMbBgGtT]?)\s*")
_DECIMAL_UNIT = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_INTEGER = re.compile(r"\s*[-+]?[0-9]+\s*")


def _count(value: Any, pattern: re.Pattern[str], units: dict[str, int], example: str) -> int:
    if isinstance(value, int):
        return value  # a default
    text = str(value)
    if _INTEGER.fullmatch(text):
        return int(text)  # a plain integer, negative or zero too: the command's own check names it
    m = pattern.fullmatch(text)
    n = float(m.group(1)) * units[m.group(2).upper()] if m else None
    if n is None or n != n or n in (float("inf"),) or n != int(n):
        raise typer.BadParameter(f"{value!r} is not {example}")
    return int(n)


def length_count(value: Any) -> int:
    """A length in tokens: 4096, 4k (= 4096), 128K, 1M (= 1,048,576)."""
    return _count(value, _LENGTH, _LENGTH_UNIT, "a length in tokens (e.g. 4096, 4k = 4,096, 128k = 131,072)")


def decimal_count(value: Any) -> int:
    """A count: 512, 4M (= 4,000,000), 2B, 1.5e11; a whole number."""
    return _count(value, _DECIMAL, _DECIMAL_UNIT, "a whole count (e.g. 512, 4M = 4,000,000, 2B, 1.5e11)")


ModelArg = Annotated[
    Optional[str],
    typer.Argument(
        help="Preset name (see --list-models), a Hugging Face id of a preset, or a local config.json (file or folder).",
        show_default=False,
    ),
]
ParamsOpt = Annotated[
    Optional[str],
    typer.Option("--params", help="Raw parameter count instead of a MODEL (7B, 350M); a Llama-style shape is assumed."),
]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", help="GPU kind or alias (see `llmctl estimate --list-gpus`).")]
GpusOpt = Annotated[
    Optional[int],
    typer.Option("--gpus", help="Total GPUs: one node up to --gpus-per-node, else whole nodes of it.", metavar="N"),
]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help="Number of nodes.", metavar="N")]
GpusPerNodeOpt = Annotated[
    Optional[int],
    typer.Option(
        "--gpus-per-node",
        help="GPUs per node (default: the GPU kind's usual node, 8 for SXM/OAM parts: `llmctl estimate --list-gpus`).",
        metavar="N",
    ),
]
SeqLenOpt = Annotated[
    int,
    typer.Option("--seq-len", parser=length_count, metavar="LEN", help="Sequence length in tokens (4096, 4k, 128k)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
JobsDirOpt = Annotated[
    Optional[str],
    typer.Option(
        "--jobs-dir",
        help="Where job folders go (default $LLMCTL_JOBS_DIR or ./llmctl-jobs). status/logs/cancel: only the jobs"
        " under it (default: every job in the index in $LLMCTL_HOME, from any folder).",
    ),
]

# --- what makes `llmctl plan`'s plan a run (llmctl.plan.emit.run_plan), and its memory margin ---------------------------
MemoryMarginOpt = Annotated[
    float,
    typer.Option(
        "--memory-margin",
        help="Fraction of each GPU's memory to keep free beyond the estimate's allocator headroom and CUDA context "
        "(default 0.06: the fragmentation measured on an H100 and NCCL's buffers; 0 plans to the last byte).",
    ),
]
DataOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--data",
        help="Training data (repeatable): a folder made by `llmctl data prepare`, or .txt/.jsonl files or folders "
        "of them. Checked now, vocabulary against the model's.",
        show_default=False,
    ),
]
TokenizerOpt = Annotated[
    Optional[str],
    typer.Option(
        "--tokenizer",
        help="With --data: a local Hugging Face tokenizer folder (default: the model folder's, else bytes).",
        show_default=False,
    ),
]
SyntheticOpt = Annotated[
    bool, typer.Option("--synthetic", help="Train on random tokens (a benchmark): no --data, on purpose.")
]
RunDirOpt = Annotated[
    Optional[str],
    typer.Option(
        "--run-dir",
        help="The run's folder: checkpoints in RUN_DIR/checkpoints, logs and metrics in RUN_DIR "
        "(default: runs/<plan name> beside the plan file: a plan's relative paths resolve against its folder).",
        show_default=False,
    ),
]
CheckpointEveryOpt = Annotated[
    float,
    typer.Option(
        "--checkpoint-every",
        help="Minutes of training between checkpoints, turned into steps at the planned step time.",
        metavar="MINUTES",
    ),
]
