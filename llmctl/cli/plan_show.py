"""What `llmctl plan` shows: the candidates table, the chosen setup with its step-time split, why the others lost,
what was dropped (rendering only; the numbers are llmctl.plan's)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from llmctl.cli import render
from llmctl.plan import planner as pl
from llmctl.spec.decisions import as_json
from llmctl.spec.setup import TrainSetup
from llmctl.units import duration, gib


def show(result: pl.PlanResult, out: dict[str, Any], top: int) -> None:
    _header(result)
    _candidates(result, top)
    _chosen(result)
    _others(result, top)
    _memory(out)
    _written(out)


def _header(result: pl.PlanResult) -> None:
    req, c = result.request, render.console
    spec = req.spec
    c.print(
        f"[bold]{escape(spec.name)}[/bold]: {spec.params:,} parameters on {req.nodes} x {req.gpus_per_node} {req.gpu.name}; "
        f"seq {req.seq_len}, global batch {req.global_batch:,} sequences ({req.global_batch * req.seq_len:,} tokens), "
        f"{req.precision.name}"
    )
    if req.gpu.plan_only:
        note = f"note: {escape(req.gpu.name)} is plan-only: {escape(req.gpu.plan_only)}; `llmctl launch` refuses it"
        c.print(note, soft_wrap=True)
    net = req.network
    inter = "-" if net.inter_node_gbytes_s is None else f"{net.inter_node_gbytes_s:.3g} GB/s per node"
    c.print(
        f"network ({escape(net.source)}): intra-node busbw {net.intra_gbytes_s:.3g} GB/s per GPU, inter-node {inter}; "
        f"overlap {req.overlap:g}; efficiency x{req.efficiency.calibration:.3g}; {result.evaluated} setups "
        f"evaluated\n"
    )


def pp_cell(s: TrainSetup) -> str:
    """The table's pp cell: '8 i2' (interleaved 1F1B, 2 stages a rank), '8 zbv', '8 1f1b', '1'."""
    if s.pp == 1:
        return "1"
    if s.pp_schedule == "interleaved-1f1b":
        return f"{s.pp} i{s.virtual_stages}"
    return f"{s.pp} {s.pp_schedule}"


def _candidates(result: pl.PlanResult, top: int) -> None:
    req, c = result.request, render.console
    cols = [
        ("#", "right"),
        ("strategy", "left"),
        ("nodes", "right"),
        ("tp", "right"),
        ("cp", "right"),
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
    piped = any(x.setup.pp > 1 for x in result.candidates[:top])
    if piped:  # only when a row has a pipeline, so that the tables without one stay as they were
        cols.insert(5, ("pp", "right"))
    experts = any(x.setup.ep > 1 for x in result.candidates[:top])
    if experts:  # likewise expert parallelism: dense models' tables stay as they were
        cols.insert(6 if piped else 5, ("ep", "right"))
    offload = " with CPU offload" if result.chosen.setup.levers.offload else ""
    t = render.table(
        f"Best setup per strategy x nodes x checkpointing{offload} (by {'tokens/s' if req.objective == 'throughput' else 'cost per token'})",
        cols,
    )
    t.columns[1].no_wrap = True  # the strategy name stays whole ("hybrid_shard")
    for i, cand in enumerate(result.candidates[:top]):
        s, p = cand.setup, cand.predicted
        d = as_json(s)
        ring = ("g" if d["cp_rotate"] == "allgather" else "p") if s.dims.cp_enabled else ""
        row = [
            str(i + 1),
            s.strategy,
            str(s.nodes),
            f"{d['tp']}{'a' if d['async_tp'] else ''}",
            f"{d['cp']}{ring}",
            *([pp_cell(s)] if piped else []),
            *([str(s.ep)] if experts else []),
            f"{s.micro_batch_size}x{s.grad_accum_steps}",
            s.checkpointing,
            s.attention,
            "yes" if s.compile else "no",
            gib(p.memory_per_gpu_bytes, 1),
            f"{p.compute_s:.2f}",
            f"{p.comm_exposed_s:.2f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.tokens_per_s_per_gpu:,.0f}",
            f"{p.mfu:.1%}",
        ]
        if req.token_budget:
            row.append(duration(p.budget_time_s))
        if req.price_per_gpu_hour is not None and req.token_budget:
            row.append(f"${p.budget_cost_usd:,.0f}")
        t.add_row(*row, style="bold green" if i == 0 else None)
    c.print(t)
    c.print(
        "[dim]compute and comm: seconds per optimizer step; comm is the communication compute does not hide; "
        "tp: tensor-parallel degree (a: async TP); cp: context-parallel degree (g: K/V all-gather, p: passed on "
        "hop by hop); mb: per data-parallel rank; MFU: causal attention counted half (the FLOPs the kernels run)"
        + ("; pp: pipeline stages and schedule (i2: interleaved 1F1B, 2 stages a rank)" if piped else "")
        + ("; ep: expert-parallel degree (the routed experts split over ep ranks)" if experts else "")
        + "[/dim]"
    )


def _chosen(result: pl.PlanResult) -> None:
    req, c = result.request, render.console
    cs, ch = result.chosen.setup, result.chosen.predicted
    c.print(
        f"\n[bold]chosen[/bold]: {result.chosen.label}, micro-batch {cs.micro_batch_size} x {cs.grad_accum_steps} "
        f"accumulation, checkpointing {cs.checkpointing}, {cs.attention} attention"
        f"{', torch.compile' if cs.compile else ''}"
        f"{f', loss in chunks of {cs.loss_chunk_tokens} tokens' if cs.loss_chunk_tokens else ''}: "
        f"{ch.tokens_per_s:,.0f} tokens/s ({ch.tokens_per_s_per_gpu:,.0f} per GPU, MFU {ch.mfu:.1%} with causal "
        f"attention counted half, {ch.mfu_palm:.1%} counted whole as PaLM and published MFU count it), "
        f"{gib(ch.memory_per_gpu_bytes, 1)} GiB per GPU; step {ch.step_time_s:.2f} s = compute "
        f"{ch.compute_s:.2f} s + exposed communication {ch.comm_exposed_s:.2f} s "
        f"(of {ch.comm_total_s:.2f} s; largest: {ch.bottleneck or 'none'})"
        + (f" + CPU offload {ch.offload_s:.2f} s" if cs.levers.offload else "")
    )
    c.print(f"[bold]global batch[/bold]: {escape(req.batch_line(ch.step_time_s))}")
    if result.sharding_choice:
        c.print(f"[bold]FULL vs HYBRID[/bold]: {escape(result.sharding_choice)}")
    if result.step_split:
        c.print(f"[bold]step split[/bold]: {escape(result.step_split)}")
    if result.precision_choice:
        c.print(f"[bold]precision[/bold]: {escape(result.precision_choice)}")
    if result.finetune_choice:
        c.print(f"[bold]fine-tuning[/bold]: {escape(result.finetune_choice)}")
    if result.offload_choice:
        c.print(f"[bold]CPU offload[/bold]: {escape(result.offload_choice)}")
    if result.memory_choice:
        c.print(f"[bold]memory[/bold]: {escape(result.memory_choice)}")
    if result.tp_choice:
        c.print(f"[bold]tensor parallel[/bold]: {escape(result.tp_choice)}")
    if result.cp_choice:
        c.print(f"[bold]context parallel[/bold]: {escape(result.cp_choice)}")
    if result.pp_choice:
        c.print(f"[bold]pipeline parallel[/bold]: {escape(result.pp_choice)}")
    if result.ep_choice:
        c.print(f"[bold]expert parallel[/bold]: {escape(result.ep_choice)}")
    if req.token_budget:
        cost = f", ${ch.budget_cost_usd:,.0f}" if ch.budget_cost_usd is not None else ""
        units = "CPU processes" if req.gpu.is_cpu else "GPUs"
        c.print(f"{req.token_budget:,} tokens: {duration(ch.budget_time_s)} on {cs.gpus} {units}{cost}")


def _others(result: pl.PlanResult, top: int) -> None:
    c = render.console
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
            held = min(len(dropped), pl.REJECTED_IN_JSON)
            where = "see --json" if held == len(dropped) else f"--json lists the first {held} of the {len(dropped)}"
            c.print(f"  ... and {len(dropped) - 4} more ({where})")


def _memory(out: dict[str, Any]) -> None:
    c = render.console
    margin = out.get("memory_margin") or {}
    if margin:
        c.print(
            f"memory margin: {gib(margin['predicted_bytes'], 1)} of {gib(margin['gpu_bytes'], 1)} GiB "
            f"per GPU predicted, including {margin['headroom_fraction']:.0%} allocator headroom "
            f"({gib(margin['allocator_headroom_bytes'], 1)} GiB) and the CUDA context "
            f"({gib(margin['cuda_context_bytes'], 1)} GiB); {gib(margin['free_bytes'], 1)} GiB "
            f"({margin['free_fraction']:.1%}) free; {margin['margin']}",
            soft_wrap=True,
        )
        if margin["warning"]:
            render.err_console.print(f"warning: {escape(margin['warning'])}", soft_wrap=True)
    host = out.get("host_memory")
    if host:
        c.print(f"host memory: {escape(host['line'])}", soft_wrap=True)
        if host["fits"] is False:
            render.err_console.print("warning: the node's memory is smaller than what the ranks hold", soft_wrap=True)


def _written(out: dict[str, Any]) -> None:
    c = render.console
    if out.get("plan_path"):
        c.print(f"\nplan written to {escape(out['plan_path'])}")
        for note in out.get("run_notes") or []:
            c.print(f"  {escape(note)}")
    elif out.get("plan_note"):
        c.print(f"\n{out['plan_note']}")
