"""What `llmctl estimate-memory` shows: the ledger and per-GPU tables, the fewest GPUs, the model and GPU lists
(rendering only; the numbers are llmctl.plan.memory's). The PNG plot is llmctl.cli.estimate_plot."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from llmctl.cli import render
from llmctl.plan import memory as mem
from llmctl.spec import hardware, models
from llmctl.units import gib


def show(result: dict[str, Any]) -> None:
    """fit_report's answer as tables and lines: the model and setup, the model states, the per-GPU components, the
    levers' notes, and on a GPU whether it fits and on how few."""
    est: mem.MemoryEstimate = result["_estimate"]
    _show_header(result, est)
    _show_states(result, est)
    if "experts" in result:
        _show_experts(result["experts"])
    if "pipeline" in result:
        _show_pipeline(result["pipeline"])
    _show_per_gpu(result, est)
    _show_notes(result, est)
    if "gpu" in result:
        _show_gpu(result, est)


def _show_header(result: dict[str, Any], est: mem.MemoryEstimate) -> None:
    s, c = est.setup, render.console
    c.print(f"[bold]{result['model']}[/bold]: {result['params']:,} parameters ({render.human_count(result['params'])})")
    if result["active_params_per_token"] != result["params"]:
        active = result["active_params_per_token"]
        c.print(f"  active per token: {active:,} ({render.human_count(active)}; FLOPs use these)")
    if result["measured"]:
        c.print("  parameters and activations measured on fake tensors (no analytical model for this model_type)")
    c.print(("assumed shape: " if result["assumed_shape"] else "") + result["shape"])
    world = f"{s.world_size} GPU{'s' if s.world_size > 1 else ''}"
    if s.nodes > 1:
        world += f" ({s.nodes} nodes x {s.gpus_per_node})"
    par = "".join(f", {k}={v}" for k in ("tp", "cp", "pp", "ep") if (v := getattr(s, k)) > 1)
    c.print(
        f"{s.precision} {s.optimizer}, {s.strategy} over {world}{par} (shard degree {s.shard_degree}), "
        f"engine {s.engine}; micro-batch {s.micro_batch_size} x {s.seq_len} tokens, {s.attention} attention, "
        f"checkpointing {s.checkpointing}\n",
        soft_wrap=True,
    )

    if ft := result.get("finetune"):
        c.print(
            f"{ft['method']} r{ft['lora_rank']} (alpha {ft['lora_alpha']:g}, dropout {ft['lora_dropout']:g}): "
            f"trainable parameters {ft['trainable_params']:,} ({ft['trainable_fraction']:.2%} of the model)\n",
            soft_wrap=True,
        )


def _show_states(result: dict[str, Any], est: mem.MemoryEstimate) -> None:
    s = est.setup
    where = ", in host memory (CPU offload)" if s.levers.offload else ""
    t = render.table(
        f"Model states: {result['bytes_per_param']:.4g} bytes/param classic budget, "
        f"{result['engine_bytes_per_param']:.4g} kept by {s.engine}{where}",
        [
            ("component", "left"),
            ("bytes/param", "right"),
            ("sharded from", "left"),
            ("GiB per GPU", "right"),
            ("GiB all GPUs", "right"),
        ],
    )
    comp_by_name = {comp.name: comp for comp in est.components + est.host_components}
    for line in est.ledger:
        comp = comp_by_name[line.name]
        stage = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}.get(line.sharded_from_stage, "never")
        t.add_row(
            line.name + (f"  [dim]({line.note})[/dim]" if line.note else ""),
            f"{line.bytes_per_param:.4g}" + (" per adapter param" if line.params is not None else ""),
            stage,
            gib(comp.bytes),
            gib(comp.bytes * s.world_size),
        )
    render.console.print(t)


def _show_experts(ex: dict[str, Any]) -> None:
    """The routed experts' line at ep > 1 (fit_report's "experts"): what one GPU keeps of them, against ep 1."""
    render.console.print(
        f"routed experts at ep {ex['ep']}: {ex['local_experts']} of {ex['experts']} per rank (FSDP over efsdp "
        f"{ex['expert_shard']}), {gib(ex['per_gpu_bytes'])} GiB per GPU (states {gib(ex['states_bytes'])} + "
        f"unsharded copies {gib(ex['unsharded_bytes'])}) instead of {gib(ex['per_gpu_bytes_at_ep1'])} at ep 1; "
        f"the all-to-alls' rows: {ex['routing']}\n",
        soft_wrap=True,
    )


def _show_pipeline(pipe: dict[str, Any]) -> None:
    """Every pp rank's memory, each at its own peak (fit_report's "pipeline"); the heaviest is the answer."""
    t = render.table(
        f"Per pipeline rank ({pipe['schedule']}, {pipe['stages_total']} stages, {pipe['virtual_stages']} per rank, "
        f"{pipe['microbatches']} micro-batch{'es' if pipe['microbatches'] > 1 else ''} per schedule run; GiB per GPU "
        "at the rank's peak)",
        [
            ("rank", "right"),
            ("stage(s)", "left"),
            ("blocks", "right"),
            ("params", "right"),
            ("params GiB", "right"),
            ("grads GiB", "right"),
            ("states GiB", "right"),
            ("activations GiB", "right"),
            ("in flight", "right"),
            ("total GiB", "right"),
        ],
    )
    for r in pipe["ranks"]:
        heaviest = r["rank"] == pipe["heaviest_rank"]
        total = gib(r["per_gpu_total_bytes"], 2)
        t.add_row(
            str(r["rank"]),
            ", ".join(map(str, r["stages"])),
            str(r["blocks"]),
            render.human_count(r["params"]),
            gib(r["params_bytes"], 2),
            gib(r["grads_bytes"], 2),
            gib(r["states_bytes"], 2),
            gib(r["activations_bytes"], 2),
            str(r["in_flight"]),
            f"[bold]{total}[/bold] (heaviest)" if heaviest else total,
        )
    render.console.print(t)
    render.console.print(
        "[dim]params: the rank's parameters after the tp split (masters sharded, compute-dtype copies whole under "
        "pp); activations: saved activations of the micro-batches in flight, the pipeline's buffers and the loss's; "
        "total adds headroom and the CUDA context. The tables below are the heaviest rank's.[/dim]",
        soft_wrap=True,
    )


def _show_per_gpu(result: dict[str, Any], est: mem.MemoryEstimate) -> None:
    s, c = est.setup, render.console
    t = render.table(
        f"Per GPU (peak phase: {_phase(est.peak_phase)})",
        [("component", "left"), ("GiB", "right"), ("live in", "left")],
    )
    for comp in est.components:
        if comp.bytes:
            t.add_row(comp.name, gib(comp.bytes, 3), ", ".join(map(_phase, comp.phases)))
    for ph, b in est.phase_bytes.items():
        t.add_row(f"[bold]= {_phase(ph)} phase total[/bold]", gib(b, 3), "peak" if ph == est.peak_phase else "")
    t.add_row(f"allocator headroom ({s.headroom_fraction:.0%})", gib(est.headroom_bytes, 3), "reserved")
    t.add_row("CUDA context + NCCL", gib(s.cuda_context_bytes, 3), "outside allocator")
    t.add_row("[bold]total per GPU[/bold]", f"[bold]{gib(est.device_bytes, 3)}[/bold]", "")
    c.print(t)
    terms = result["layer_activation_terms"]
    hf = {k: v for k, v in terms.items() if ": HF" in k}
    if hf:
        kept = {k: v for k, v in terms.items() if not k.endswith(" not kept")}
        # Adapters' corrections are savings (what a frozen layer no longer keeps): said as such, not as negative GiB.
        saved = {k.removeprefix("LoRA: ").removesuffix(" not kept"): -v for k, v in terms.items() if k not in kept}
        less = f"; with adapters it does not keep {', '.join(f'{k} {gib(v, 3)}' for k, v in saved.items())} GiB"
        c.print(
            "[dim]one block without checkpointing keeps "
            + ", ".join(f"{k} {gib(v, 3)}" for k, v in kept.items())
            + " GiB"
            + (less if saved else "")
            + f"; the HF-only lines ({gib(sum(hf.values()), 3)} GiB per block) are what a fused RMSNorm and"
            " SwiGLU (torchtitan, Liger, torch.compile) do not keep[/dim]",
            soft_wrap=True,
        )


def _show_notes(result: dict[str, Any], est: mem.MemoryEstimate) -> None:
    """The levers' own lines (CPU offload, host memory, context parallelism, float8), then the peak."""
    c = render.console
    if "offload" in result:
        _show_offload(result["offload"], result.get("gpu"))
    if "host" in result:
        c.print(f"host memory: {escape(result['host']['line'])}", soft_wrap=True)
    if "context_parallel" in result:
        _show_cp(result["context_parallel"])
    if "float8" in result:
        _show_float8(result["float8"])
    c.print(
        f"peak allocated {gib(est.peak_allocated_bytes)} GiB (torch.cuda.max_memory_allocated), "
        f"reserved {gib(est.peak_reserved_bytes)} GiB, device total {gib(est.device_bytes)} GiB",
        soft_wrap=True,
    )


def _show_gpu(result: dict[str, Any], est: mem.MemoryEstimate) -> None:
    """On a GPU kind: whether it fits, the largest micro-batch, the fewest GPUs per strategy and checkpointing mode."""
    s, c = est.setup, render.console
    ok = "[green]fits[/green]" if result["fits"] else "[red]does NOT fit[/red]"
    margin = result["memory_margin"]
    if (result.get("offload") or {}).get("host_fits") is False:
        ok += " (host memory)" if est.device_bytes <= margin["capacity_bytes"] else " (GPU and host memory)"
    c.print(
        f"\n{result['gpu']} ({gib(result['gpu_memory_bytes'], 1)} GiB, {gib(margin['capacity_bytes'], 1)} usable): "
        f"{ok} at micro-batch {s.micro_batch_size}; largest micro-batch that fits: {result['max_micro_batch'] or 'none'}"
    )
    c.print(margin["line"], soft_wrap=True)
    t = render.table(
        f"Fewest {result['gpu']} GPUs that fit (micro-batch {s.micro_batch_size}, {result['node_gpus']} per node)",
        [("strategy", "left"), ("GPUs", "right"), ("nodes", "right"), ("GiB per GPU", "right"), ("note", "left")],
    )
    for strat, row in result["min_gpus_by_strategy"].items():
        t.add_row(
            strat,
            str(row["gpus"] or "-"),
            str(row["nodes"] or "-"),
            gib(row["per_gpu_total_bytes"]),
            row["note"],
        )
    c.print(t)
    t = render.table(
        f"Fewest GPUs per checkpointing mode ({s.strategy}, mb {s.micro_batch_size})",
        [
            ("checkpointing", "left"),
            ("GPUs", "right"),
            ("nodes", "right"),
            ("GiB per GPU", "right"),
            ("activations GiB", "right"),
            ("note", "left"),
        ],
    )
    for mode, row in result["min_gpus_by_checkpointing"].items():
        t.add_row(
            mode,
            str(row["gpus"] or "-"),
            str(row["nodes"] or "-"),
            gib(row["per_gpu_total_bytes"]),
            gib(row["activations_bytes"]),
            row["note"],
        )
    c.print(t)
    if "fewest_any_layout" in result:  # llmctl's engine (the zero engine's ledger has no layout search)
        f = result["fewest_any_layout"]
        n = f"{f['gpus']} ({f['nodes']} node{'s' if f['nodes'] > 1 else ''} x {f['gpus'] // f['nodes']})" if f else ""
        where = f"{n}: {f['line']}" if f else "none up to 4,096 nodes"
        c.print(f"fewest {result['gpu']} GPUs in any layout the planner searches (tp, cp, pp): {where}", soft_wrap=True)


def _show_offload(off: dict[str, Any], gpu: str | None) -> None:
    """What CPU offload keeps on the host, against the node's memory (fit_report's "offload")."""
    cap = off["host_capacity_bytes_per_node"]
    n = off["gpus_per_node"]
    if cap is None:
        verdict = f"not checked: the GPU catalog does not know {gpu}'s node memory" if gpu else "no --gpu to check"
    else:
        ok = "[green]fits[/green]" if off["host_fits"] else "[red]does NOT fit[/red]"
        verdict = f"{ok} in {gib(cap, 0)} GiB ({gpu}'s node in the GPU catalog: {gib(cap // n, 0)} per GPU)"
    render.console.print(
        f"CPU offload: the host holds {gib(off['host_bytes_per_node'], 1)} GiB per node of {n} GPUs "
        f"({gib(off['host_bytes_per_gpu'], 1)} per GPU; {off['pinned']}): {verdict}; the GPU holds "
        "the layers in flight (one layer's shard copied in, one gradient shard before its copy out) and the "
        "activations",
        soft_wrap=True,
    )


def _show_cp(ring: dict[str, Any]) -> None:
    """What context parallelism does to this rank's memory (fit_report's "context_parallel")."""
    balance = "head-tail load balance" if ring["load_balance"] else "no load balance"
    render.console.print(
        f"context parallel: cp {ring['cp']} holds {ring['tokens_per_rank']:,} tokens of each sequence per GPU "
        f"({balance}): activations {gib(ring['activations_bytes'], 2)} GiB against "
        f"{gib(ring['activations_at_cp1_bytes'], 2)} GiB at cp 1 ({gib(ring['per_gpu_total_at_cp1_bytes'], 1)}"
        f" GiB per GPU in all); states shard over {ring['fsdp_shard']} ranks (data-parallel x cp). Ring attention "
        f"({ring['rotate']} rotation) holds, while one layer's attention runs, "
        f"{gib(ring['ring_forward_kv_bytes'], 3)} GiB of keys/values in flight and a "
        f"{gib(ring['ring_forward_merge_bytes'], 3)} GiB fp32 merge of the partial outputs (forward), "
        f"{gib(ring['ring_backward_kv_bytes'], 3)} + {gib(ring['ring_backward_grads_bytes'], 3)} GiB in "
        "backward (fp32 gradient accumulators and the dK/dV ring"
        + (", or the recompute's forward ring" if ring["ring_backward_is_recompute"] else "")
        + ")",
        soft_wrap=True,
    )


def _show_float8(f8: dict[str, Any]) -> None:
    """What float8 converts (fit_report's "float8")."""
    gather = ", and FSDP all-gathers their weights in float8" if f8["float8_all_gather"] else ""
    render.console.print(
        f"float8 ({f8['recipe']}): torchao converts {f8['converted_linears']} linears, "
        f"{f8['float8_flops_fraction']:.1%} of the model FLOPs{gather}; kept in {f8['compute_dtype']}: "
        f"{', '.join(f8['kept_in_compute_dtype'])}. {f8['note']}",
        soft_wrap=True,
    )


def list_models() -> None:
    t = render.table(
        "Model presets",
        [("name", "left"), ("params", "right"), ("active/token", "right"), ("shape", "left"), ("HF id", "left")],
    )
    for name in models.preset_names():
        spec, entry = models.from_preset(name), models.preset_entry(name)
        active = f"{spec.active_params_per_token:,}" if spec.moe else "="
        t.add_row(name, f"{spec.params:,}", active, spec.describe(), entry.get("hf_id", "-"))
    render.console.print(t)


def list_gpus() -> None:
    t = render.table(
        "GPU catalog (dense peak TFLOP/s)",
        [
            ("name", "left"),
            ("memory GiB", "right"),
            ("bf16", "right"),
            ("fp16", "right"),
            ("tf32", "right"),
            ("fp32", "right"),
            ("fp8", "right"),
            ("link", "left"),
            ("GB/s", "right"),
        ],
    )
    for g in hardware.gpu_catalog().values():
        f = [("-" if g.tflops.get(k) is None else f"{g.tflops[k]:g}") for k in ("bf16", "fp16", "tf32", "fp32", "fp8")]
        t.add_row(g.name, f"{g.memory_gib:.1f}", *f, g.link, f"{g.link_gbytes_s:g}")
    render.console.print(t)


def _phase(name: str) -> str:
    """A phase as the tables show it: loss_backward (the JSON's key) is "loss's backward"."""
    return {"loss_backward": "loss's backward"}.get(name, name)
