"""`llmctl export`: an engine checkpoint -> a Hugging Face folder (safetensors shards, config, tokenizer files).

Only registers the command and renders the result; the work is in llmctl.engine.export, imported when the command
runs (it checks the command line before it imports torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from llmctl.engine.export import ExportResult

CheckpointArg = Annotated[
    Path,
    typer.Argument(
        help="The plan's checkpoint.dir (its newest complete step_* is exported) or one step_* folder.",
        show_default=False,
    ),
]
OutOpt = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        help="The Hugging Face folder to write (written beside it, then renamed into place).",
        show_default=False,
    ),
]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--dtype",
        help="bf16 | fp32. Default: bf16 if the plan trained in bf16 or bf16-mixed, else fp32.",
        show_default=False,
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace a non-empty --out folder that llmctl export wrote (only once the new one is complete).",
    ),
]
PlanOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--plan",
        help="The plan that trained the checkpoint, for checkpoints without plan.yaml (wins over it).",
        show_default=False,
    ),
]
MergeOpt = Annotated[
    bool,
    typer.Option(
        "--merge",
        help="LoRA checkpoints: also write OUT/merged, the base (model.weights) with the adapters folded in.",
    ),
]
MaxShardOpt = Annotated[
    str,
    typer.Option("--max-shard-size", help="Largest safetensors file (e.g. 5GB, 500MiB; K/M/G are binary)."),
]


def export(
    checkpoint: CheckpointArg,
    out: OutOpt,
    dtype: DtypeOpt = None,
    force: ForceOpt = False,
    plan: PlanOpt = None,
    max_shard_size: MaxShardOpt = "5GB",
    merge: MergeOpt = False,
) -> None:
    """Turn an engine checkpoint into a folder that transformers' AutoModelForCausalLM.from_pretrained loads
    (vocabulary padding removed; one process, no GPU). A LoRA run's checkpoint becomes a peft adapter folder
    (PeftModel.from_pretrained), and with --merge the merged model too."""
    from llmctl.engine.export import ExportRequest, export_checkpoint, resolve_checkpoint, resolve_plan
    from llmctl.errors import InputError
    from llmctl.units import fmt_bytes, parse_bytes

    request = ExportRequest(
        checkpoint=checkpoint,
        out=out,
        dtype=dtype,
        force=force,
        plan=plan,
        max_shard_bytes=parse_bytes(max_shard_size, "--max-shard-size"),
    )

    trained = resolve_plan(resolve_checkpoint(checkpoint)[0], plan)[0]
    if trained.setup.finetune.adapters:
        from llmctl.engine import export_lora

        for line in export_lora.summary_lines(export_lora.export_adapter(request, merge=merge)):
            typer.echo(line)
        return
    if merge:
        raise InputError("--merge applies to LoRA checkpoints; this one holds the whole model", hint="drop --merge")

    def progress(i: int, n: int, name: str, nbytes: int) -> None:
        typer.echo(f"  [{i}/{n}] {name} ({fmt_bytes(nbytes)})", err=True)

    for line in summary_lines(export_checkpoint(request, on_shard=progress)):
        typer.echo(line)


def summary_lines(r: ExportResult) -> list[str]:
    from llmctl.units import fmt_bytes

    step = f" (step {r.step})" if r.step is not None else ""
    padding = (
        f" ({r.checkpoint_vocab_size - r.vocab_size} padding rows of the checkpoint's {r.checkpoint_vocab_size} dropped)"
        if r.checkpoint_vocab_size != r.vocab_size
        else ""
    )
    return [
        f"exported {r.step_dir}{step} -> {r.out}",
        f"  {r.tensors} tensors in {r.shards} shard{'s' if r.shards > 1 else ''}, {fmt_bytes(r.total_bytes)} "
        f"{r.dtype}, vocabulary {r.vocab_size}{padding}",
        f"  plan: {r.plan_source}; tokenizer: {r.tokenizer}",
        f"  {r.seconds:.1f} s, peak RSS {fmt_bytes(r.peak_rss_bytes)}",
        f"  load it: AutoModelForCausalLM.from_pretrained({str(r.out)!r})",
    ]


def register(app: typer.Typer) -> None:
    app.command("export")(export)
