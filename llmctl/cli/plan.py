"""`llmctl plan`: the sharding, micro-batch, accumulation, checkpointing and kernel that give the most tokens/s (or
the lowest cost) on this cluster and its measured network; writes plan.yaml with the predictions recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.markup import escape

from llmctl.cli import render
from llmctl.cli.options import JsonOpt, ModelArg, NodesOpt, ParamsOpt, SeqLenOpt
from llmctl.errors import InputError, SpecError
from llmctl.plan import comm as cm
from llmctl.plan import planner as pl
from llmctl.spec import hardware, models
from llmctl.spec import planfile as pf

# The message size the planner reads a bench-net curve at when it has none better: FSDP's per-layer collectives
# for 7B-70B models are 100-800 MB; bench-net's bucket range (16-64 MiB) is the conservative read.
DEFAULT_BENCH_SIZE_BYTES = 64 * 2**20


class ClusterFile(BaseModel):
    """A cluster description (examples/clusters/plan-*.yaml)."""

    model_config = ConfigDict(extra="forbid")
    gpu: str
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    inter_node_gbps: Optional[float] = Field(None, gt=0)
    """Per node, all NICs together, Gbit/s (taken as achievable bus bandwidth)."""
    intra_node_gbps: Optional[float] = Field(None, gt=0)
    """Per-GPU intra-node bus bandwidth, Gbit/s (default: catalog link x 0.8)."""
    price_per_gpu_hour: Optional[float] = Field(None, ge=0)


def load_cluster(path: str) -> ClusterFile:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise SpecError(f"cannot read cluster file {p}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{p}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{p}: a cluster file must be a YAML mapping (gpu, nodes, gpus_per_node, ...)")
    try:
        return ClusterFile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise SpecError(f"{p}: {loc}: {msg}") from None


def _merge(flag: Any, file_value: Any, name: str, path: str | None) -> Any:
    """A flag and the cluster file may both give a number only if they agree."""
    if flag is not None and file_value is not None and flag != file_value:
        raise SpecError(
            f"--{name.replace('_', '-')} {flag} disagrees with {path}: {name}: {file_value}",
            hint="drop the flag or fix the cluster file",
        )
    return flag if flag is not None else file_value


def bench_network(
    path: str, gpus_per_node: int, nodes: int, intra_gbps: float | None, inter_gbps: float | None
) -> cm.Network:
    """A Network whose busbw comes from a bench-net report (llmctl.netbench.report.load_bench)."""
    from llmctl.netbench.report import load_bench

    rep = load_bench(path)
    if rep.ranks_per_node != gpus_per_node:
        raise SpecError(
            f"{path} measured {rep.ranks_per_node} GPUs per node but the cluster has {gpus_per_node}",
            hint="run bench-net on this cluster's nodes, or fix --gpus-per-node",
        )
    multi = len(rep.nodes) > 1
    if multi and inter_gbps is not None:
        raise InputError(
            f"--inter-gbps conflicts with the inter-node bandwidth measured in {path}",
            hint="give one of --net and --inter-gbps",
        )
    if nodes > 1 and not multi and inter_gbps is None:
        raise SpecError(
            f"{path} was measured on one node; the plan spans {nodes} nodes",
            hint="run bench-net across nodes, or add --inter-gbps X",
        )
    intra_fallback = intra_gbps / 8 if intra_gbps else None

    def intra(collective: str, size: float) -> float:
        if intra_fallback is not None:
            return intra_fallback
        coll = collective if rep.result("intra_node" if multi else "world", collective) else "all_reduce"
        return rep.intra_node_busbw_gbytes_s(int(size), coll)

    def curve(collective: str, scope: str, size: float) -> float:
        if scope == "intra":
            return intra(collective, size)
        if not multi:
            node_bw = cm.gbps_to_gbytes_s(inter_gbps or 0.0)
            return min(intra(collective, size), node_bw if scope == "cross" else node_bw / gpus_per_node)
        if scope == "cross":
            coll = collective if rep.result("world", collective) else "all_reduce"
            return rep.busbw_gbytes_s("world", coll, int(size))
        bw = rep.inter_node_busbw_gbytes_s(int(size), "all_reduce")
        return float(bw) if bw else 0.0

    intra_bw = intra("all_gather", DEFAULT_BENCH_SIZE_BYTES)
    inter_node = (
        rep.inter_node_busbw_gbytes_s(DEFAULT_BENCH_SIZE_BYTES, "all_reduce", per_node=True)
        if multi
        else (cm.gbps_to_gbytes_s(inter_gbps) if inter_gbps else None)
    )
    return cm.Network(intra_bw, inter_node, curve=curve, source=f"bench-net {path}")


def read_metrics(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise SpecError(f"cannot read metrics file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p}: not a text file") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{p} line {i}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise SpecError(f"{p} line {i}: expected a JSON object per line")
        out.append(rec)
    return out


def to_plan(result: pl.PlanResult, name: str | None = None) -> pf.Plan | None:
    """The chosen candidate as the engine's plan file (None for --params: the engine needs an architecture)."""
    req, c = result.request, result.chosen
    spec = req.spec
    if spec.source == "preset":
        model = pf.ModelSection(preset=spec.name)
    elif spec.source == "config":
        model = pf.ModelSection(config=spec.name)
    else:
        return None
    training = pf.TrainingSection(
        precision=req.precision,
        micro_batch_size=c.micro_batch,
        grad_accum_steps=c.grad_accum,
        seq_len=req.seq_len,
        activation_checkpointing=c.checkpointing,
        attention=c.attention,
        compile=c.compile,
        token_budget=req.token_budget,
        max_steps=None if req.token_budget else 1000,
    )
    return pf.Plan(
        name=name or f"{Path(spec.name).stem}-{pl.SHARDING_NAME[c.strategy]}-{c.nodes}x{c.gpus_per_node}",
        model=model,
        hardware=pf.HardwareSection(gpu=req.gpu.name, nodes=c.nodes, nproc_per_node=c.gpus_per_node),
        parallel=pf.ParallelSection(sharding=pl.SHARDING_NAME[c.strategy]),
        training=training,
        predicted=pf.Predicted(
            tokens_per_s=round(c.tokens_per_s, 1),
            tokens_per_s_per_gpu=round(c.tokens_per_s_per_gpu, 1),
            mfu=round(c.mfu, 4),
            step_time_s=round(c.step_time_s, 4),
            memory_per_gpu_bytes=c.memory_per_gpu_bytes,
        ),
    )


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
        f"{req.precision}"
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
    short = {"full_shard": "FULL", "hybrid_shard": "HYBRID", "no_shard": "NO_SHARD"}
    t = render.table(
        f"Best setup per strategy x nodes x checkpointing (by "
        f"{'tokens/s' if req.objective == 'throughput' else 'cost per token'})",
        cols,
    )
    for i, cand in enumerate(result.candidates[:top]):
        row = [
            str(i + 1),
            short[cand.strategy],
            str(cand.nodes),
            f"{cand.micro_batch}x{cand.grad_accum}",
            cand.checkpointing,
            cand.attention,
            "yes" if cand.compile else "no",
            render.gib(cand.memory_per_gpu_bytes, 1),
            f"{cand.compute_s:.2f}",
            f"{cand.comm_exposed_s:.2f}",
            f"{cand.tokens_per_s:,.0f}",
            f"{cand.tokens_per_s_per_gpu:,.0f}",
            f"{cand.mfu:.1%}",
        ]
        if req.token_budget:
            row.append(_duration(cand.budget_time_s))
        if req.price_per_gpu_hour is not None and req.token_budget:
            row.append(f"${cand.budget_cost_usd:,.0f}")
        t.add_row(*row, style="bold green" if i == 0 else None)
    c.print(t)
    c.print("[dim]compute and comm: seconds per optimizer step; comm is the communication compute does not hide[/dim]")
    ch = result.chosen
    c.print(
        f"\n[bold]chosen[/bold]: {ch.label}, micro-batch {ch.micro_batch} x {ch.grad_accum} accumulation, "
        f"checkpointing {ch.checkpointing}, {ch.attention} attention{', torch.compile' if ch.compile else ''}: "
        f"{ch.tokens_per_s:,.0f} tokens/s ({ch.tokens_per_s_per_gpu:,.0f} per GPU, MFU {ch.mfu:.1%}), "
        f"{render.gib(ch.memory_per_gpu_bytes, 1)} GiB per GPU; step {ch.step_time_s:.2f} s = compute "
        f"{ch.compute_s:.2f} s + exposed communication {ch.comm_exposed_s:.2f} s "
        f"(of {ch.comm_total_s:.2f} s; largest: {ch.bottleneck or 'none'})"
    )
    if req.token_budget:
        cost = f", ${ch.budget_cost_usd:,.0f}" if ch.budget_cost_usd is not None else ""
        c.print(f"{req.token_budget:,} tokens: {_duration(ch.budget_time_s)} on {ch.gpus} GPUs{cost}")
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
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU kind (see `llmctl estimate --list-gpus`).")] = None,
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
    checkpointing: Annotated[Optional[str], typer.Option("--checkpointing", help="Pin: none | full.")] = None,
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
        typer.Option("--calibrate", help="An engine run's metrics.jsonl: fit the efficiency to its measured tokens/s."),
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Candidates to show.")] = 8,
    json_out: JsonOpt = False,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Where to write the plan.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing plan file.")] = False,
    no_write: Annotated[bool, typer.Option("--no-write", help="Do not write a plan file.")] = False,
) -> None:
    """Choose FULL vs HYBRID sharding, micro-batch, accumulation, checkpointing and kernels for MODEL on a cluster."""
    if top < 1:
        raise InputError(f"--top must be >= 1, got {top}")
    cf = load_cluster(cluster) if cluster else None
    gpu_name = _merge(gpu, cf.gpu if cf else None, "gpu", cluster)
    n_nodes = _merge(nodes, cf.nodes if cf else None, "nodes", cluster)
    gpn = _merge(gpus_per_node, cf.gpus_per_node if cf else None, "gpus_per_node", cluster)
    inter = _merge(inter_gbps, cf.inter_node_gbps if cf else None, "inter_node_gbps", cluster)
    intra = _merge(intra_gbps, cf.intra_node_gbps if cf else None, "intra_node_gbps", cluster)
    price_h = _merge(price, cf.price_per_gpu_hour if cf else None, "price_per_gpu_hour", cluster)
    if gpu_name is None:
        raise InputError("no GPU kind given", hint="pass --gpu KIND or --cluster cluster.yaml")
    n_nodes = 1 if n_nodes is None else n_nodes
    gpn = 1 if gpn is None else gpn
    for label, v in (("--nodes", n_nodes), ("--gpus-per-node", gpn)):
        if v < 1:
            raise InputError(f"{label} must be a positive integer, got {v}")
    if inter is not None and inter <= 0 or intra is not None and intra <= 0:
        raise InputError("--inter-gbps and --intra-gbps must be positive")
    if global_batch is not None and global_batch_tokens is not None:
        raise InputError("give either --global-batch (sequences) or --global-batch-tokens, not both")
    if seq_len < 1:
        raise InputError(f"--seq-len must be a positive integer, got {seq_len}")
    gpu_spec = hardware.resolve_gpu(gpu_name)
    hardware.ClusterSpec(gpu_spec, n_nodes, gpn, inter, None, price_h)  # its own consistency checks
    spec = models.resolve_model(model, params)
    gb = global_batch
    if global_batch_tokens is not None:
        if global_batch_tokens < seq_len:
            raise InputError(f"--global-batch-tokens {global_batch_tokens} is less than one sequence ({seq_len})")
        gb = global_batch_tokens // seq_len
    budget = models.parse_count(tokens) if tokens is not None else None

    if net:
        network = bench_network(net, gpn, n_nodes, intra, inter)
    else:
        intra_bw = intra / 8 if intra else gpu_spec.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY
        if n_nodes > 1 and inter is None:
            raise InputError(
                f"{n_nodes} nodes but no inter-node bandwidth",
                hint="pass --inter-gbps X (per node, Gbit/s) or --net bench.json",
            )
        network = cm.Network(
            intra_bw, cm.gbps_to_gbytes_s(inter) if inter else None, source="given" if intra or inter else "catalog"
        )

    eff = pl.Efficiency()
    cal = None
    if calibrate:
        cal = pl.calibrate(read_metrics(calibrate), source=calibrate)
        eff = pl.Efficiency(calibration=cal.factor)
    req = pl.PlanRequest(
        spec=spec,
        gpu=gpu_spec,
        nodes=n_nodes,
        gpus_per_node=gpn,
        network=network,
        seq_len=seq_len,
        global_batch_seqs=gb,
        token_budget=budget,
        price_per_gpu_hour=price_h,
        objective=objective.strip().lower(),
        precision=precision,
        strategy=strategy,
        micro_batch=micro_batch,
        checkpointing=checkpointing,
        attention=attention,
        compile=compile_,
        overlap=overlap,
        efficiency=eff,
    )
    result = pl.plan(req)

    out: dict[str, Any] = {
        "model": spec.name,
        "params": spec.params,
        "gpu": gpu_spec.name,
        "nodes": n_nodes,
        "gpus_per_node": gpn,
        "seq_len": seq_len,
        "global_batch_seqs": req.global_batch,
        "objective": req.objective,
        "network": {
            "source": network.source,
            "intra_busbw_gbytes_s": network.intra_gbytes_s,
            "inter_node_gbytes_s": network.inter_node_gbytes_s,
        },
        "overlap": overlap,
        "efficiency": {
            "kernel": eff.kernel,
            "gpu": eff.gpu.get(gpu_spec.name, 1.0),
            "tokens_half": eff.tokens_half,
            "hidden_half": eff.hidden_half,
            "compile_speedup": eff.compile_speedup,
            "calibration": eff.calibration,
        },
        "calibration": None
        if cal is None
        else {
            "factor": cal.factor,
            "steps": cal.steps,
            "measured_tokens_per_s": cal.measured_tokens_per_s,
            "predicted_tokens_per_s": cal.predicted_tokens_per_s,
            "method": cal.method,
        },
        "evaluated": result.evaluated,
        "chosen": result.chosen.as_dict(),
        "candidates": [c.as_dict() for c in result.candidates[:top]],
        "variants_considered": len(result.variants),
        "why_lost": [result.why_lost[i] for i in range(1, min(top, len(result.candidates)))],
        "rejected": list(dict.fromkeys(result.rejected))[:50],
        "plan_path": None,
    }
    if not no_write:
        plan_obj = to_plan(result)
        if plan_obj is None:
            out["plan_note"] = "no plan file written: --params gives no architecture for the engine (pass a preset)"
        else:
            path = Path(output or "plan.yaml")
            if path.exists() and not force:
                raise InputError(
                    f"{path} already exists; not overwriting it", hint="pass --force, or -o another path, or --no-write"
                )
            pf.save_plan(plan_obj, path)
            out["plan_path"] = str(path)
    if json_out:
        render.print_json(out)
    else:
        _render(result, out, top)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
