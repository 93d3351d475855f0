"""`llmctl plan`: the sharding, tensor and context parallelism, micro-batch, accumulation, checkpointing and kernel that
give the most tokens/s (or the lowest cost) on this cluster and its measured network; writes plan.yaml with the predictions
recorded."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.cli import plan_compare, render
from llmctl.cli import plan_show as show
from llmctl.cli.compare_options import (
    BudgetOpt,
    CompareOpt,
    DeadlineOpt,
    InterconnectOpt,
    PlotOpt,
    PriceBasisOpt,
    PricesOpt,
)
from llmctl.cli.decision_options import with_decisions
from llmctl.cli.options import (
    CheckpointEveryOpt,
    DataOpt,
    GpuOpt,
    GpusOpt,
    GpusPerNodeOpt,
    JsonOpt,
    MemoryMarginOpt,
    ModelArg,
    NodesOpt,
    ParamsOpt,
    RunDirOpt,
    SyntheticOpt,
    TokenizerOpt,
)
from llmctl.cli.plan_checks import check_flags as _check_flags
from llmctl.cli.plan_checks import plan_target
from llmctl.cli.plan_options import (
    ClusterOpt,
    EpochsOpt,
    GlobalBatchOpt,
    GlobalBatchTokensOpt,
    InterGbpsOpt,
    IntraGbpsOpt,
    NetOpt,
)
from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan import planner as pl
from llmctl.plan.emit import DEFAULT_CHECKPOINT_MINUTES, run_plan, writes_plan
from llmctl.plan.memory.margin import DEFAULT_MEMORY_MARGIN
from llmctl.plan.request import build_request
from llmctl.spec import planfile as pf
from llmctl.spec import planpaths
from llmctl.spec.optimizer_states import caveat_note


@with_decisions("plan", "pin", after="memory_margin")
def plan_command(
    model: ModelArg = None,
    params: ParamsOpt = None,
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    cluster: ClusterOpt = None,
    net: NetOpt = None,
    intra_gbps: IntraGbpsOpt = None,
    inter_gbps: InterGbpsOpt = None,
    global_batch: GlobalBatchOpt = None,
    global_batch_tokens: GlobalBatchTokensOpt = None,
    tokens: Annotated[
        Optional[str], typer.Option("--tokens", help="Token budget for time and cost (e.g. 2B, 1.5e11).")
    ] = None,
    epochs: EpochsOpt = None,
    price: Annotated[Optional[float], typer.Option("--price", help="USD per GPU-hour.")] = None,
    objective: Annotated[
        str, typer.Option("--objective", help="throughput | cost (cost per token; needs --price).")
    ] = "throughput",
    memory_margin: MemoryMarginOpt = DEFAULT_MEMORY_MARGIN,
    overlap: Annotated[
        float, typer.Option("--overlap", help="Fraction of overlappable communication hidden behind compute, 0..1.")
    ] = cm.DEFAULT_OVERLAP,
    calibrate: Annotated[
        Optional[str],
        typer.Option(
            "--calibrate",
            help="An engine run's metrics.jsonl, or the file `llmctl tune` writes: fit the efficiency to the measured "
            "tokens/s.",
        ),
    ] = None,
    data: DataOpt = None,
    tokenizer: TokenizerOpt = None,
    synthetic: SyntheticOpt = False,
    run_dir: RunDirOpt = None,
    checkpoint_every: CheckpointEveryOpt = DEFAULT_CHECKPOINT_MINUTES,
    compare: CompareOpt = None,
    deadline: DeadlineOpt = None,
    budget: BudgetOpt = None,
    prices: PricesOpt = None,
    price_basis: PriceBasisOpt = "on-demand",
    interconnect: InterconnectOpt = None,
    plot: PlotOpt = None,
    top: Annotated[int, typer.Option("--top", help="Candidates to show.")] = 8,
    json_out: JsonOpt = False,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Where to write the plan.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing plan file.")] = False,
    no_write: Annotated[bool, typer.Option("--no-write", help="Do not write a plan file.")] = False,
    decisions: dict[str, Any] | None = None,
) -> None:
    """Choose full_shard vs hybrid_shard, tensor and context parallelism, micro-batch, accumulation, checkpointing and
    kernels for MODEL on a cluster."""
    if top < 1:
        raise InputError(f"--top must be >= 1, got {top}")
    run_flags = _run_flags(data, synthetic, run_dir, checkpoint_every, epochs)
    if epochs is not None and tokens is not None:
        raise InputError("give either --epochs or --tokens (each sets the run's length), not both")
    _check_flags(no_write, output, force, run_flags, tokenizer, data, synthetic, params, checkpoint_every)
    options = {
        "params": params,
        "gpu": gpu,
        "gpus": gpus,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "cluster": cluster,
        "net": net,
        "intra_gbps": intra_gbps,
        "inter_gbps": inter_gbps,
        "global_batch": global_batch,
        "global_batch_tokens": global_batch_tokens,
        "tokens": tokens,
        "price": price,
        "objective": objective,
        "overlap": overlap,
        "calibrate": calibrate,
        "memory_margin": memory_margin,
    }
    flags = {"deadline": deadline, "budget": budget, "prices": prices, "price_basis": price_basis, "plot": plot}
    flags["interconnect"] = interconnect
    chosen = {"--gpu": gpu, "--gpus": gpus, "--nodes": nodes, "--cluster": cluster, "--net": net, "--price": price}
    chosen["--objective"] = None if objective == "throughput" else objective
    file_flags = [f for f, given in (("-o", output), ("--force", force), ("--no-write", no_write)) if given] + run_flags
    d = dict(decisions or {})
    if plan_compare.wanted(compare, chosen, flags, file_flags):
        return plan_compare.run(model, options, d, compare, flags, json_out)  # type: ignore[arg-type]
    req, cal = build_request(model, options, d)
    epochs_line = None
    if epochs is not None:  # the length as a token budget of whole steps: the table's time and cost are the run's
        from llmctl.data.epochs import epoch_steps

        steps, epochs_line = epoch_steps(epochs, data, req.seq_len, req.global_batch)
        req = replace(req, token_budget=steps * req.global_batch * req.seq_len)
    # The plan file's place is checked before the search, as --plot's is: a refusal costs nothing and prints no plan.
    target = plan_target(output, force) if not no_write and writes_plan(req.spec) else None
    result = pl.plan(req)
    out = result.as_dict(top, cal)
    if states_note := caveat_note(req.optimizer_states):  # only when asked: the planner never picks smaller states
        out["optimizer_states_note"] = states_note
        render.err_console.print(f"note: {states_note}", soft_wrap=True)
    refusal = (
        None
        if no_write
        else _write(result, out, json_out, data, synthetic, tokenizer, run_dir, checkpoint_every, target, force)
    )
    if epochs_line is not None:
        out.setdefault("run_notes", []).insert(0, epochs_line)
    if json_out:
        render.print_json(out)
    else:
        show.show(result, out, top)
    if refusal is not None:
        raise refusal


def _run_flags(
    data: list[str] | None, synthetic: bool, run_dir: str | None, checkpoint_every: float, epochs: float | None
) -> list[str]:
    """The flags given that shape the run the plan file describes (meaningless without a plan file)."""
    given = (
        ("--data", data),
        ("--synthetic", synthetic),
        ("--run-dir", run_dir),
        ("--checkpoint-every", checkpoint_every != DEFAULT_CHECKPOINT_MINUTES),
        ("--epochs", epochs is not None),
    )
    return [flag for flag, on in given if on]


def _write(
    result: pl.PlanResult,
    out: dict[str, Any],
    json_out: bool,
    data: list[str] | None,
    synthetic: bool,
    tokenizer: str | None,
    run_dir: str | None,
    checkpoint_every: float,
    target: Path | None,
    force: bool,
) -> InputError | None:
    """Write the plan file (what it says is added to `out`); the refusal to raise once the plan is shown when the
    file exists and --force was not given (the user's file stays as it is)."""
    plan_obj, notes = run_plan(result, data, synthetic, tokenizer, run_dir, checkpoint_every)
    if plan_obj is not None and data:
        from llmctl.data.epochs import many_passes_warning

        if warning := many_passes_warning(plan_obj):
            notes.append(f"warning: {warning}")
    if notes:
        out["run_notes"] = notes
    if plan_obj is None:
        out["plan_note"] = "no plan file written: --params gives no architecture for the engine (pass a preset)"
        return None
    path = target or Path("plan.yaml")
    if path.exists() and not force:  # made while the plan was searched (checked before it: `plan_target`)
        if json_out:  # (the table ends with the error line instead)
            out["plan_note"] = f"not written: {path} already exists"
        return InputError(
            f"{path} already exists; the plan above was not written",
            hint=f"pass --force to replace it, or -o another path (e.g. -o {path.with_name(path.stem + '-new' + path.suffix)})",
        )
    pf.save_plan(_relocated(plan_obj, path.parent, run_dir is not None), path)
    out["plan_path"] = str(path)
    return None


def _relocated(plan_obj: pf.Plan, folder: Path, run_dir_given: bool) -> pf.Plan:
    """The plan as its file says it: the paths given on the command line (relative to here) relative to the file's
    folder (llmctl.spec.planpaths), which they resolve against; the default run folder, runs/<name>, stays as it
    is: beside the plan (said in a note when that is not here)."""
    keys = (
        planpaths.PATH_KEYS if run_dir_given else tuple(k for k in planpaths.PATH_KEYS if k not in planpaths.RUN_KEYS)
    )
    moved = pf.plan_from_dict(planpaths.relocate(plan_obj.model_dump(mode="json"), folder, keys), "the plan to write")
    if not run_dir_given and Path(folder).absolute() != Path.cwd().absolute():
        render.err_console.print(
            f"note: paths in a plan resolve against its folder: the run folder is {folder / moved.logging.dir}",
            soft_wrap=True,
        )
    return moved


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
