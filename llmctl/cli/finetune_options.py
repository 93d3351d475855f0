"""The training method's options, shared by `estimate-memory` and `plan` (Annotated aliases, as llmctl.cli.options),
and the Finetune they make."""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.errors import InputError
from llmctl.spec.finetune import FULL, Finetune

DEFAULT_RANK = FULL.rank
DEFAULT_ALPHA = FULL.alpha

FinetuneOpt = Annotated[
    str,
    typer.Option(
        "--finetune",
        help="full (every weight trains) | lora (adapters on a frozen base in the compute dtype) | qlora (adapters on "
        "a frozen 4-bit NF4 base; torchao, bf16 or fp16).",
    ),
]
LoraRankOpt = Annotated[
    int, typer.Option("--lora-rank", metavar="R", help="The adapters' rank r (with --finetune lora or qlora).")
]
LoraAlphaOpt = Annotated[
    float,
    typer.Option("--lora-alpha", metavar="A", help="The adapters' alpha: their output is scaled by alpha / rank."),
]


def finetune_from(method: str, rank: int, alpha: float) -> Finetune:
    """The Finetune of the flags, each bad value named by its flag (one line, exit 2)."""
    ft_method = method.strip().lower()
    if ft_method == "full" and (rank != DEFAULT_RANK or alpha != DEFAULT_ALPHA):
        raise InputError("--lora-rank and --lora-alpha apply to adapters", hint="add --finetune lora (or qlora)")
    if isinstance(rank, bool) or rank < 1:
        raise InputError(f"--lora-rank must be a positive integer, got {rank}")
    if not alpha > 0:
        raise InputError(f"--lora-alpha must be a positive number, got {alpha}")
    return Finetune(method, rank, alpha)
