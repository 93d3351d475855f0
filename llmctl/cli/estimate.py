"""`llmctl estimate-memory` (alias `estimate`): does it fit, and how many GPUs of which kind are needed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Annotated, Any, Optional

import typer

from llmctl.cli import estimate_plot, render
from llmctl.cli import estimate_show as show
from llmctl.cli.decision_options import with_decisions
from llmctl.cli.options import (
    GpuOpt,
    GpusOpt,
    GpusPerNodeOpt,
    JsonOpt,
    MemoryMarginOpt,
    ModelArg,
    NodesOpt,
    ParamsOpt,
)
from llmctl.errors import InputError
from llmctl.plan import memory as mem
from llmctl.plan.memory.margin import DEFAULT_MEMORY_MARGIN
from llmctl.spec import decisions as dec
from llmctl.spec import hardware, models, rules
from llmctl.spec.finetune import from_flags
from llmctl.spec.optimizer_states import caveat_note
from llmctl.spec.parallel import canonical_strategy
from llmctl.spec.precision import for_gpu
from llmctl.spec.setup import DEFAULT_HEADROOM_FRACTION, TrainSetup
from llmctl.units import GIB

POSITIVE = {
    "seq_len": "--seq-len",
    "micro_batch_size": "--micro-batch",
    "grad_accum_steps": "--grad-accum",
    "tp": "--tp",
    "cp": "--cp",
    "pp": "--pp",
}
"""Decisions that must be at least 1, checked first and named by their flag."""


@with_decisions("estimate", "value", after="gpus_per_node")
def estimate_memory(
    model: ModelArg = None,
    params: ParamsOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    headroom: Annotated[
        float, typer.Option("--headroom", help="Allocator fragmentation headroom, a fraction of peak allocated.")
    ] = DEFAULT_HEADROOM_FRACTION,
    cuda_context_gib: Annotated[
        float, typer.Option("--cuda-context-gib", help="CUDA context + NCCL buffers outside the allocator, GiB.")
    ] = 1.0,
    memory_margin: MemoryMarginOpt = DEFAULT_MEMORY_MARGIN,
    json_out: JsonOpt = False,
    plot: Annotated[
        Optional[str], typer.Option("--plot", help="Write a PNG of per-component bars per strategy.")
    ] = None,
    list_models: Annotated[bool, typer.Option("--list-models", help="List the model presets and exit.")] = False,
    list_gpus: Annotated[bool, typer.Option("--list-gpus", help="List the GPU catalog and exit.")] = False,
    decisions: dict[str, Any] | None = None,
) -> None:
    """Per-GPU memory of training MODEL: model states by component, activations, peak; fit and GPU count."""
    if list_models or list_gpus:
        if list_models:
            show.list_models()
        if list_gpus:
            show.list_gpus()
        return
    d = dict(decisions or {})
    for name, flag in POSITIVE.items():
        if d[name] < 1:  # named by its flag here; the setup's own check names the field
            raise InputError(f"{flag} must be a positive integer, got {d[name]}")
    spec = models.resolve_model(model, params)
    gpu_spec = hardware.resolve_gpu(gpu) if gpu else None
    # The GPU kind's usual node (8 when no kind is given): what --gpus and --nodes fill, and the node the "how many
    # GPUs" answer counts in. Nothing given estimates one GPU.
    node_gpus = gpus_per_node or (gpu_spec.node_gpus if gpu_spec else 8)
    if gpus is None and nodes is None:
        if gpus_per_node is None and canonical_strategy(d["strategy"]) == "hybrid_shard":
            raise InputError("hybrid_shard needs --nodes N --gpus-per-node G")
        n_nodes, gpn = hardware.cluster_shape(None, None, gpus_per_node, 1)
    else:
        n_nodes, gpn = hardware.cluster_shape(gpus, nodes, gpus_per_node, node_gpus)
    d["precision"], precision_why = for_gpu(d["precision"], gpu_spec)  # auto: fp16-mixed on a V100, and why
    method = from_flags({k: d.pop(k) for k in ("finetune", "lora_rank", "lora_alpha")})
    # The model's own refusal of ep first (a dense model, experts ep does not divide): a setup of ep ranks would
    # otherwise be refused for the ranks it borrows from, which is not the reason.
    if (err := rules.model_problem(SimpleNamespace(ep=d["ep"]), spec, only=("ep split",))) is not None:
        raise err
    base = TrainSetup(finetune=method, headroom_fraction=headroom, cuda_context_bytes=int(cuda_context_gib * GIB))
    setup = dec.with_values(base, **d, nodes=n_nodes, gpus_per_node=gpn)
    if (err := rules.model_problem(setup, spec, only=("ring attention",))) is not None:
        raise InputError(f"--cp {d['cp']}: {err.message}", hint="use --cp 1")
    kernel = setup.kernel(gpu_spec, spec)
    if setup.attention.fixed and kernel != setup.attention:  # what the engine runs (Gemma 2, gpt-oss: no SDPA path)
        render.err_console.print(
            f"note: {spec.name} ({spec.model_type}) has no {setup.attention} attention in transformers; the engine runs "
            f"{kernel}, estimated here",
            soft_wrap=True,
        )
    if kernel != setup.attention:  # auto: the kernel the engine picks on this GPU kind (a plan file's default)
        setup = dec.with_values(setup, attention=kernel)
    if precision_why:
        render.err_console.print(f"note: --precision auto is {precision_why}")
    if states_note := caveat_note(setup.optimizer_states):
        render.err_console.print(f"note: {states_note}", soft_wrap=True)
    if not 0 <= memory_margin < 1:
        raise InputError(f"--memory-margin must be a fraction in [0, 1), got {memory_margin}")
    result = mem.fit_report(spec, setup, gpu_spec, node_gpus=max(node_gpus, gpn), memory_margin=memory_margin)
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
