"""`llmctl plan`: the sharding, micro-batch, accumulation, checkpointing and kernel that give the most tokens/s (or
the lowest cost) on this cluster and its measured network; writes plan.yaml with the predictions recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from llmctl.cli import render
from llmctl.cli.options import GpuOpt, JsonOpt, ModelArg, NodesOpt, ParamsOpt, SeqLenOpt
from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan import planner as pl
from llmctl.plan.emit import to_plan, train_from_local_weights
from llmctl.plan.request import build_request
from llmctl.spec import planfile as pf


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400 * 2:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _render(result: pl.PlanResult, out: dict[str, Any], top: int) -> None:
    req, c = result.request, render.console
    spec = req.spec
    c.print(
        f"[bold]{escape(spec.name)}[/bold]: {spec.params:,} parameters on {req.nodes} x {req.gpus_per_node} {req.gpu.name}; "
        f"seq {req.seq_len}, global batch {req.global_batch} sequences ({req.global_batch * req.seq_len:,} tokens), "
        f"{req.precision.name}"
    )
    net = req.network
    inter = "-" if net.inter_node_gbytes_s is None else f"{net.inter_node_gbytes_s:.3g} GB/s per node"
    c.print(
        f"network ({escape(net.source)}): intra-node busbw {net.intra_gbytes_s:.3g} GB/s per GPU, inter-node {inter}; "
        f"overlap {req.overlap:g}; efficiency x{req.efficiency.calibration:.3g}; {result.evaluated} setups "
        f"evaluated\n"
    )
    cols = [
        ("#", "right"),
        ("strategy", "left"),
        ("nodes", "right"),
        ("mb x acc", "right"),
        ("ckpt", "left"),
        ("attn", "left"),
        ("compile", "left"),
        ("GiB", "right"),
        ("compute", "right"),
        ("comm", "right"),
        ("tokens/s", "right"),
        ("per GPU", "right"),
        ("MFU", "right"),
    ]
    if req.token_budget:
        cols.append(("time", "right"))
    if req.price_per_gpu_hour is not None and req.token_budget:
        cols.append(("cost", "right"))
    t = render.table(
        f"Best setup per strategy x nodes x checkpointing (by {'tokens/s' if req.objective == 'throughput' else 'cost per token'})",
        cols,
    )
    t.columns[1].no_wrap = True  # the strategy name stays whole ("hybrid_shard")
    for i, cand in enumerate(result.candidates[:top]):
        s, p = cand.setup, cand.predicted
        row = [
            str(i + 1),
            s.strategy,
            str(s.nodes),
            f"{s.micro_batch_size}x{s.grad_accum_steps}",
            s.checkpointing,
            s.attention,
            "yes" if s.compile else "no",
            render.gib(p.memory_per_gpu_bytes, 1),
            f"{p.compute_s:.2f}",
            f"{p.comm_exposed_s:.2f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.tokens_per_s_per_gpu:,.0f}",
            f"{p.mfu:.1%}",
        ]
        if req.token_budget:
            row.append(_duration(p.budget_time_s))
        if req.price_per_gpu_hour is not None and req.token_budget:
            row.append(f"${p.budget_cost_usd:,.0f}")
        t.add_row(*row, style="bold green" if i == 0 else None)
    c.print(t)
    c.print("[dim]compute and comm: seconds per optimizer step; comm is the communication compute does not hide[/dim]")
    cs, ch = result.chosen.setup, result.chosen.predicted
    c.print(
        f"\n[bold]chosen[/bold]: {result.chosen.label}, micro-batch {cs.micro_batch_size} x {cs.grad_accum_steps} "
        f"accumulation, checkpointing {cs.checkpointing}, {cs.attention} attention"
        f"{', torch.compile' if cs.compile else ''}"
        f"{f', loss in chunks of {cs.loss_chunk_tokens} tokens' if cs.loss_chunk_tokens else ''}: "
        f"{ch.tokens_per_s:,.0f} tokens/s ({ch.tokens_per_s_per_gpu:,.0f} per GPU, MFU {ch.mfu:.1%}), "
        f"{render.gib(ch.memory_per_gpu_bytes, 1)} GiB per GPU; step {ch.step_time_s:.2f} s = compute "
        f"{ch.compute_s:.2f} s + exposed communication {ch.comm_exposed_s:.2f} s "
        f"(of {ch.comm_total_s:.2f} s; largest: {ch.bottleneck or 'none'})"
    )
    if result.memory_choice:
        c.print(f"[bold]memory[/bold]: {escape(result.memory_choice)}")
    if req.token_budget:
        cost = f", ${ch.budget_cost_usd:,.0f}" if ch.budget_cost_usd is not None else ""
        c.print(f"{req.token_budget:,} tokens: {_duration(ch.budget_time_s)} on {cs.gpus} GPUs{cost}")
    if len(result.candidates) > 1:
        c.print("\n[bold]why the others lost[/bold]:")
        for i in range(1, min(top, len(result.candidates))):
            c.print(f"  {i + 1}. {escape(result.why_lost[i])}")
    dropped = list(dict.fromkeys(result.rejected))
    if dropped:
        c.print(f"\n[bold]dropped[/bold] ({len(dropped)} setup families):")
        for line in dropped[:4]:
            c.print(f"  {escape(line)}")
        if len(dropped) > 4:
            c.print(f"  ... and {len(dropped) - 4} more (see --json)")
    if out.get("plan_path"):
        c.print(f"\nplan written to {escape(out['plan_path'])}")
    elif out.get("plan_note"):
        c.print(f"\n{out['plan_note']}")


def plan_command(
    model: ModelArg = None,
    params: ParamsOpt = None,
    gpu: GpuOpt = None,
    nodes: NodesOpt = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per node.")] = None,
    cluster: Annotated[
        Optional[str],
        typer.Option(
            "--cluster",
            help="Cluster YAML: gpu, nodes, gpus_per_node, inter_node_gbps, intra_node_gbps, price_per_gpu_hour.",
        ),
    ] = None,
    net: Annotated[Optional[str], typer.Option("--net", help="bench-net JSON (measured busbw).")] = None,
    intra_gbps: Annotated[
        Optional[float],
        typer.Option("--intra-gbps", help="Per-GPU intra-node bus bandwidth, Gbit/s (default: catalog link x 0.8)."),
    ] = None,
    inter_gbps: Annotated[
        Optional[float],
        typer.Option(
            "--inter-gbps",
            help="Per-node inter-node bandwidth, Gbit/s, all NICs together (e.g. 50, or 3200 for 8 x 400G).",
        ),
    ] = None,
    seq_len: SeqLenOpt = 2048,
    global_batch: Annotated[
        Optional[int],
        typer.Option("--global-batch", help="Global batch in sequences, held fixed (default: max(128, GPUs))."),
    ] = None,
    global_batch_tokens: Annotated[
        Optional[int],
        typer.Option("--global-batch-tokens", help="Global batch in tokens (rounded to whole sequences)."),
    ] = None,
    tokens: Annotated[
        Optional[str], typer.Option("--tokens", help="Token budget for time and cost (e.g. 2B, 1.5e11).")
    ] = None,
    price: Annotated[Optional[float], typer.Option("--price", help="USD per GPU-hour.")] = None,
    objective: Annotated[str, typer.Option("--objective", help="throughput | cost (cost per token).")] = "throughput",
    precision: Annotated[str, typer.Option("--precision", help="bf16-mixed | bf16 | fp32.")] = "bf16-mixed",
    strategy: Annotated[
        Optional[str], typer.Option("--strategy", help="Pin: full_shard | hybrid_shard | no_shard.")
    ] = None,
    micro_batch: Annotated[Optional[int], typer.Option("--micro-batch", help="Pin the micro-batch.")] = None,
    checkpointing: Annotated[
        Optional[str], typer.Option("--checkpointing", help="Pin: none | selective | partial:K | full.")
    ] = None,
    loss_chunk: Annotated[
        Optional[int],
        typer.Option("--loss-chunk", help="Pin the loss chunk in tokens (0: whole logits; default: try both)."),
    ] = None,
    attention: Annotated[Optional[str], typer.Option("--attention", help="Pin: eager | sdpa | flash.")] = None,
    compile_: Annotated[
        Optional[bool],
        typer.Option(
            "--compile/--no-compile", help="Pin torch.compile on or off (default: try both).", show_default=False
        ),
    ] = None,
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
    top: Annotated[int, typer.Option("--top", help="Candidates to show.")] = 8,
    json_out: JsonOpt = False,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Where to write the plan.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing plan file.")] = False,
    no_write: Annotated[bool, typer.Option("--no-write", help="Do not write a plan file.")] = False,
) -> None:
    """Choose full_shard vs hybrid_shard, micro-batch, accumulation, checkpointing and kernels for MODEL on a cluster."""
    if top < 1:
        raise InputError(f"--top must be >= 1, got {top}")
    options = {
        "params": params,
        "gpu": gpu,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "cluster": cluster,
        "net": net,
        "intra_gbps": intra_gbps,
        "inter_gbps": inter_gbps,
        "seq_len": seq_len,
        "global_batch": global_batch,
        "global_batch_tokens": global_batch_tokens,
        "tokens": tokens,
        "price": price,
        "objective": objective,
        "precision": precision,
        "loss_chunk": loss_chunk,
        "attention": attention,
        "overlap": overlap,
        "calibrate": calibrate,
    }
    req, cal = build_request(model, options, strategy, micro_batch, checkpointing, compile_)
    result = pl.plan(req)
    out = result.as_dict(top, cal)
    refusal = None
    if not no_write:
        plan_obj = train_from_local_weights(to_plan(result))
        if plan_obj is None:
            out["plan_note"] = "no plan file written: --params gives no architecture for the engine (pass a preset)"
        else:
            path = Path(output or "plan.yaml")
            if path.exists() and not force:
                # The user's file stays as it is; the plan computed is still shown, then the refusal and the way out.
                refusal = InputError(
                    f"{path} already exists; the plan above was not written",
                    hint=f"pass --force to replace it, or -o another path (e.g. -o {path.with_name(path.stem + '-new' + path.suffix)})",
                )
                if json_out:  # (the table ends with the error line instead)
                    out["plan_note"] = f"not written: {path} already exists"
            else:
                pf.save_plan(plan_obj, path)
                out["plan_path"] = str(path)
    if json_out:
        render.print_json(out)
    else:
        _render(result, out, top)
    if refusal is not None:
        raise refusal


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
