"""`llmctl estimate-memory` (alias `estimate`): does it fit, and how many GPUs of which kind are needed."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmctl.cli import estimate_plot, render
from llmctl.cli import estimate_show as show
from llmctl.cli.finetune_options import (
    DEFAULT_ALPHA,
    DEFAULT_RANK,
    FinetuneOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    finetune_from,
)
from llmctl.cli.options import (
    AttentionOpt,
    CheckpointingOpt,
    CpOpt,
    EngineOpt,
    GpuOpt,
    GpusOpt,
    GpusPerNodeOpt,
    GradAccumOpt,
    JsonOpt,
    LossChunkOpt,
    MicroBatchOpt,
    ModelArg,
    NodesOpt,
    OffloadOpt,
    OptimizerOpt,
    OptimizerStatesOpt,
    ParamsOpt,
    PpOpt,
    PrecisionOpt,
    SeqLenOpt,
    StrategyOpt,
    TpOpt,
)
from llmctl.errors import InputError
from llmctl.families.context_parallel import cp_problem
from llmctl.plan import memory as mem
from llmctl.spec import hardware, models
from llmctl.spec.optimizer_states import caveat_note
from llmctl.spec.precision import for_gpu
from llmctl.spec.setup import ATTENTIONS, DEFAULT_HEADROOM_FRACTION, ENGINES, MemoryLevers, TrainSetup, canonical


def estimate_memory(
    model: ModelArg = None,
    params: ParamsOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    strategy: StrategyOpt = "full_shard",
    precision: PrecisionOpt = "auto",
    optimizer: OptimizerOpt = "adamw",
    optimizer_states: OptimizerStatesOpt = "auto",
    seq_len: SeqLenOpt = 2048,
    micro_batch: MicroBatchOpt = 1,
    grad_accum: GradAccumOpt = 1,
    checkpointing: CheckpointingOpt = "none",
    loss_chunk: LossChunkOpt = 0,
    attention: AttentionOpt = "sdpa",
    engine: EngineOpt = "fsdp2",
    tp: TpOpt = 1,
    cp: CpOpt = 1,
    pp: PpOpt = 1,
    offload: OffloadOpt = False,
    finetune: FinetuneOpt = "full",
    lora_rank: LoraRankOpt = DEFAULT_RANK,
    lora_alpha: LoraAlphaOpt = DEFAULT_ALPHA,
    headroom: Annotated[
        float, typer.Option("--headroom", help="Allocator fragmentation headroom, a fraction of peak allocated.")
    ] = DEFAULT_HEADROOM_FRACTION,
    cuda_context_gib: Annotated[
        float, typer.Option("--cuda-context-gib", help="CUDA context + NCCL buffers outside the allocator, GiB.")
    ] = 1.0,
    json_out: JsonOpt = False,
    plot: Annotated[
        Optional[str], typer.Option("--plot", help="Write a PNG of per-component bars per strategy.")
    ] = None,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the model presets and exit.")] = False,
    list_gpus: Annotated[bool, typer.Option("--list-gpus", help="List the GPU catalog and exit.")] = False,
) -> None:
    """Per-GPU memory of training MODEL: model states by component, activations, peak; fit and GPU count."""
    if list_models or list_gpus:
        if list_models:
            show.list_models()
        if list_gpus:
            show.list_gpus()
        return
    for flag, v in (
        ("--seq-len", seq_len),
        ("--micro-batch", micro_batch),
        ("--grad-accum", grad_accum),
        ("--tp", tp),
        ("--cp", cp),
        ("--pp", pp),
    ):
        if v < 1:  # named by its flag here; the memory model's own check names the field
            raise InputError(f"{flag} must be a positive integer, got {v}")
    spec = models.resolve_model(model, params)
    if cp > 1 and (problem := cp_problem(spec, seq_len)):
        raise InputError(f"--cp {cp}: {problem}", hint="use --cp 1")
    asked = canonical(attention, ATTENTIONS, "attention")
    if spec.attention_kernel(asked) != asked:  # what the engine will run (Gemma 2 and gpt-oss have no SDPA path)
        attention = spec.attention_kernel(asked)
        render.err_console.print(
            f"note: {spec.name} ({spec.model_type}) has no {asked} attention in transformers; the engine runs "
            f"{attention}, estimated here",
            soft_wrap=True,
        )
    gpu_spec = hardware.resolve_gpu(gpu) if gpu else None
    # The GPU kind's usual node (8 when no kind is given): what --gpus and --nodes fill, and the node the "how many
    # GPUs" answer counts in. Nothing given estimates one GPU.
    node_gpus = gpus_per_node or (gpu_spec.node_gpus if gpu_spec else 8)
    if gpus is None and nodes is None:
        n_nodes, gpn = hardware.cluster_shape(None, None, gpus_per_node, 1)
    else:
        n_nodes, gpn = hardware.cluster_shape(gpus, nodes, gpus_per_node, node_gpus)
    if (
        strategy.strip().lower().replace("-", "_") in ("hybrid_shard", "hybrid", "hsdp")
        and gpus_per_node is None
        and gpus is None
        and nodes is None
    ):
        raise InputError("hybrid_shard needs --nodes N --gpus-per-node G")
    if offload and canonical(engine, ENGINES, "engine") != "fsdp2":
        raise InputError(f"--offload is FSDP2's CPU offload (CPUOffloadPolicy), not --engine {engine}'s")
    precision_policy, precision_why = for_gpu(precision, gpu_spec)  # auto: fp16-mixed on a V100, and why
    setup = TrainSetup(
        precision=precision_policy,
        optimizer=optimizer,
        optimizer_states=optimizer_states,
        strategy=strategy,
        engine=engine,
        nodes=n_nodes,
        gpus_per_node=gpn,
        tp=tp,
        cp=cp,
        pp=pp,
        micro_batch_size=micro_batch,
        grad_accum_steps=grad_accum,
        seq_len=seq_len,
        checkpointing=checkpointing,
        attention=attention,
        loss_chunk_tokens=loss_chunk,
        headroom_fraction=headroom,
        cuda_context_bytes=int(cuda_context_gib * render.GIB),
        levers=MemoryLevers(offload=offload),
        finetune=finetune_from(finetune, lora_rank, lora_alpha),
    )
    if precision_why:
        render.err_console.print(f"note: --precision auto is {precision_why}")
    if states_note := caveat_note(setup.optimizer_states):
        render.err_console.print(f"note: {states_note}", soft_wrap=True)
    result = mem.fit_report(spec, setup, gpu_spec, node_gpus=max(node_gpus, gpn))
    if plot:
        estimate_plot.write(spec, setup, gpu_spec, plot)
    if json_out:
        render.print_json({k: v for k, v in result.items() if not k.startswith("_")})
    else:
        show.show(result)
        if plot:
            render.console.print(f"\nplot written to {plot}")


def register(app: typer.Typer) -> None:
    app.command("estimate-memory")(estimate_memory)
    app.command("estimate", help="Alias of estimate-memory.")(estimate_memory)
