"""Options shared by several commands, defined once as Annotated aliases (huggingface_hub's CLI style)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

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
GpusOpt = Annotated[Optional[int], typer.Option("--gpus", help="Total GPUs (fills nodes of --gpus-per-node).")]
NodesOpt = Annotated[Optional[int], typer.Option("--nodes", help="Number of nodes.")]
GpusPerNodeOpt = Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node.")]
StrategyOpt = Annotated[
    str,
    typer.Option(
        "--strategy", help="no_shard (DDP) | zero1 | shard_grad_op (ZeRO-2) | full_shard (ZeRO-3) | hybrid_shard."
    ),
]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="fp32 | bf16-mixed | fp16-mixed | bf16 (pure).")]
OptimizerOpt = Annotated[
    str,
    typer.Option("--optimizer", help="adamw | adamw-8bit | adafactor | lion | sgd | none (inference: weights only)."),
]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", help="Sequence length in tokens.")]
MicroBatchOpt = Annotated[int, typer.Option("--micro-batch", help="Micro-batch size (sequences per GPU).")]
CheckpointingOpt = Annotated[
    str,
    typer.Option(
        "--checkpointing",
        help="Activation checkpointing: none | selective (attention output and every other matmul kept, the rest "
        "recomputed) | partial:K (every K-th block recomputed whole) | full (block inputs kept).",
    ),
]
LossChunkOpt = Annotated[
    int,
    typer.Option(
        "--loss-chunk",
        help="LM head + loss over chunks of N tokens (only one chunk's b*s*V logits exist); 0: whole logits.",
    ),
]
AttentionOpt = Annotated[
    str, typer.Option("--attention", help="eager (keeps the s^2 scores) | sdpa | flash (no s^2 term).")
]
EngineOpt = Annotated[
    str,
    typer.Option(
        "--engine", help="fsdp2 (llmctl's engine: no persistent half copy) | zero (DeepSpeed-style 18-byte ledger)."
    ),
]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree (divides weights and activations).")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree (divides layers).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
JobsDirOpt = Annotated[
    Optional[str],
    typer.Option("--jobs-dir", help="Where job folders go (default $LLMCTL_JOBS_DIR or ./llmctl-jobs)."),
]
