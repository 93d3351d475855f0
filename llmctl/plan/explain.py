"""Why the planner chose what it chose: the precision, what a setup's recompute costs, what the other checkpointing
modes would fit and cost, why tensor and context parallelism won or lost, and one sentence per losing setup
(torch-free)."""

from __future__ import annotations

from dataclasses import replace

from llmctl.families.context_parallel import cp_problem
from llmctl.families.tensor_parallel import plan_problem
from llmctl.plan import float8 as f8
from llmctl.plan import flops as fl
from llmctl.plan import memory as mem
from llmctl.plan.explain_kernels import attention_rates
from llmctl.plan.ranking import recompute_cost, sort_key
from llmctl.plan.request import PlanRequest
from llmctl.plan.search import MemorySearch
from llmctl.plan.space import Choice
from llmctl.plan.timing import Candidate, evaluate, float8_cast_s
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.setup import TrainSetup
from llmctl.units import GIB


def explain_precision(req: PlanRequest, chosen: Candidate) -> str:
    """One sentence on the precision: what `auto` chose on a GPU without bf16 and why (req.precision_why), and under
    float8 what runs on its tensor cores and what the casts cost: 'fp8-tensorwise: 86.8% of the model FLOPs (the
    linears torchao converts) at the fp8 peak, 1979 TFLOP/s, the rest at bf16's 989.5; ...'. Empty otherwise."""
    p, s, gpu = req.precision, chosen.setup, req.gpu
    parts = [req.precision_why] if req.precision_why else []
    if p.float8:
        share = f8.linear_flops_per_token(req.spec)[0] / fl.model_flops_per_token(req.spec, req.seq_len)
        tokens = s.micro_batch_size * req.seq_len // s.cp
        cast = s.grad_accum_steps * sum(float8_cast_s(req, s, tokens))
        gather = (
            "; FSDP all-gathers the converted weights in float8 (1 byte a parameter)" if p.float8_all_gather else ""
        )
        parts.append(
            f"{p.name}: {share:.1%} of the model FLOPs (the linears torchao converts) at the fp8 peak, "
            f"{gpu.peak_tflops(p.linear_dtype):g} TFLOP/s, the rest (attention, LM head) at {p.compute_dtype}'s "
            f"{gpu.peak_tflops(p.compute_dtype):g}; the dynamic float8 casts take {_s(cast)} of the "
            f"{_s(chosen.predicted.compute_s)} compute per step{gather}; MFU is against the {p.compute_dtype} peak"
        )
        seen = " and ".join(f"{what} ran {got:.2f}x (predicted {want:.2f}x)" for what, got, want in f8.MEASURED_H100)
        parts.append(
            f"the float8 gain is an upper bound: against bf16-mixed on one H100, {seen} "
            "(docs/measurements/h100-gpu-tier.json); measure with `llmctl tune` or re-plan with --calibrate"
        )
    return "; ".join(parts)


def explain_memory_choice(
    req: PlanRequest, chosen: Candidate, search: MemorySearch, modes: list[str], chunks: list[int]
) -> str:
    """One sentence on the chosen checkpointing mode and loss against the other modes on the same strategy, nodes,
    kernel and compile: 'selective checkpointing: micro-batch 16 fits, recompute costs 15% more compute time; no
    checkpointing: only micro-batch 4 fits (18% fewer tokens/s); full checkpointing: recompute would cost 17% more
    time'."""
    s = chosen.setup
    per_gpu = s.per_rank_batch
    loss = f", loss in chunks of {s.loss_chunk_tokens} tokens" if s.loss_chunk_tokens else ""
    cost = recompute_cost(req, s)
    parts = [
        f"{ckpt_modes.label(s.checkpointing)}{loss}: micro-batch {s.micro_batch_size} fits"
        + (f", recompute costs {cost:.0%} more compute time" if cost > 0.005 else "")
    ]
    for mode in modes:
        if mode == s.checkpointing:
            continue
        alts = []
        for chunk in chunks if s.tp == 1 else [0]:
            mbs = search.micro_batches(replace(Choice.of(s), checkpointing=mode, loss_chunk_tokens=chunk), per_gpu, [])
            for mb in mbs:
                if s.pp_microbatches and (per_gpu // mb) % s.pp_microbatches:
                    continue  # pinned pp microbatches must divide the accumulation
                alt_setup = replace(
                    s, micro_batch_size=mb, grad_accum_steps=per_gpu // mb, checkpointing=mode, loss_chunk_tokens=chunk
                )
                alts.append(evaluate(req, alt_setup))
        label = ckpt_modes.label(mode)
        if not alts:
            parts.append(f"{label}: does not fit")
            continue
        alt = min(alts, key=lambda c: sort_key(req, c))
        tps = chosen.predicted.tokens_per_s
        ratio = alt.predicted.tokens_per_s / tps if tps else 1.0
        if alt.setup.micro_batch_size < s.micro_batch_size:
            parts.append(
                f"{label}: only micro-batch {alt.setup.micro_batch_size} fits ({1 - ratio:.0%} fewer tokens/s)"
            )
        elif ratio < 1:
            extra = recompute_cost(req, alt.setup) - cost
            why = f"recompute would cost {extra:.0%} more time" if extra > 0.005 else f"{1 - ratio:.0%} fewer tokens/s"
            parts.append(f"{label}: {why}")
    return "; ".join(parts)


def why_lost(c: Candidate, best: Candidate, req: PlanRequest) -> str:
    """One sentence: the biggest reason `c` predicts fewer tokens/s (or a higher cost) than `best`."""
    s, b = c.setup, best.setup
    p, bp = c.predicted, best.predicted
    ckpt = ckpt_modes.label(s.checkpointing)
    name = (
        f"{c.label} ({ckpt}, {s.attention}{', compiled' if s.compile else ''}, "
        f"mb {s.micro_batch_size} x {s.grad_accum_steps})"
    )
    ratio = p.tokens_per_s / bp.tokens_per_s if bp.tokens_per_s else 0.0
    if req.objective == "cost":
        ratio = p.tokens_per_s_per_gpu / bp.tokens_per_s_per_gpu if bp.tokens_per_s_per_gpu else 0.0
    pct = f"{(1 - ratio) * 100:.0f}% {'fewer tokens/s' if req.objective == 'throughput' else 'more cost per token'}"
    # Compare per-GPU seconds per token, split into compute and exposed comm.
    tok_c, tok_b = p.tokens_per_step / s.gpus, bp.tokens_per_step / b.gpus
    comp_d = p.compute_s / tok_c - bp.compute_s / tok_b
    comm_d = p.comm_exposed_s / tok_c - bp.comm_exposed_s / tok_b
    if req.objective == "throughput" and s.gpus < b.gpus and p.tokens_per_s_per_gpu >= bp.tokens_per_s_per_gpu:
        return f"{name}: uses {s.gpus} GPUs vs {b.gpus}; {pct} even with less exposed communication"
    if comm_d >= comp_d and p.comm_exposed_s > 0:
        return (
            f"{name}: {p.comm_exposed_s:.2f} s/step exposed communication ({p.bottleneck}) vs "
            f"{bp.comm_exposed_s:.2f} s; {pct}"
        )
    causes = []
    extra, best_extra = recompute_cost(req, s), recompute_cost(req, b)
    if extra > best_extra + 0.005:
        causes.append(
            f"recompute adds {extra:.0%} compute time" + (f" vs {best_extra:.0%}" if best_extra > 0.005 else "")
        )
    if s.attention != b.attention and attention_rates(req, s.attention) != attention_rates(req, b.attention):
        causes.append(
            f"{s.attention} attention: {attention_rates(req, s.attention)[0]} vs {b.attention}: "
            f"{attention_rates(req, b.attention)[0]}"
        )
    if b.compile and not s.compile:
        causes.append("no torch.compile")
    if s.gpus < b.gpus:
        causes.append(f"uses {s.gpus} GPUs vs {b.gpus}")
    if not causes and s.micro_batch_size < b.micro_batch_size:
        causes.append(f"smaller micro-batch ({s.micro_batch_size} vs {b.micro_batch_size})")
    detail = ", ".join(causes) or "slower compute"
    return f"{name}: compute {p.compute_s:.2f} s/step vs {bp.compute_s:.2f} s ({detail}); {pct}"


# --- tensor parallelism ------------------------------------------------------------------------------------------
def activation_bytes(setup: TrainSetup, req: PlanRequest) -> int:
    """Bytes per GPU of what a step keeps for backward and its loss at the peak phase (the memory model's components
    that are neither model states nor FSDP's unsharded buffers nor CPU offload's nor ring attention's transient
    ones)."""
    est = mem.estimate(req.spec, setup)
    peak = est.peak_phase
    return sum(
        c.bytes
        for c in est.components
        if peak in c.phases and c.bytes_per_param is None and not c.name.startswith(("unsharded", "ring", "offload"))
    )


def tp_share(c: Candidate) -> tuple[float, float]:
    """(share of the step exposed in TP collectives, TP collectives' total seconds per step)."""
    p = c.predicted
    total = sum(o.time_per_step_s for o in p.comm_ops if o.phase == "tp")
    return (p.tp_comm_exposed_s / p.step_time_s if p.step_time_s else 0.0), total


def _link(req: PlanRequest) -> str:
    return "the measured intra-node links" if req.network.curve is not None else req.gpu.link


def _s(seconds: float) -> str:
    """Seconds for a sentence: 2 decimals, or milliseconds to 2 significant digits below 0.1 s (a tiny model)."""
    return f"{seconds:.2f} s" if seconds >= 0.1 or seconds == 0 else f"{seconds * 1e3:.2g} ms"


def _short(c: Candidate) -> str:
    s = c.setup
    return f"{c.label}, mb {s.micro_batch_size} x {s.grad_accum_steps}, {ckpt_modes.label(s.checkpointing)}"


def _gap(req: PlanRequest, c: Candidate, best: Candidate) -> str:
    """'12% fewer tokens/s' (throughput) or '12% more cost per token' (cost) of `c` against `best`."""
    if req.objective == "cost":
        mine, top = c.predicted.tokens_per_s_per_gpu, best.predicted.tokens_per_s_per_gpu
        return f"{(top / mine - 1 if mine else 0):.0%} more cost per token"
    mine, top = c.predicted.tokens_per_s, best.predicted.tokens_per_s
    return f"{(1 - mine / top if top else 0):.0%} fewer tokens/s"


def _tp_costs(req: PlanRequest, c: Candidate, verb: str = "cost") -> str:
    """'its collectives cost 24% of the step on NVLink4 (2.32 s of 9.71 s)', or with async TP 'its collectives (0.74 s
    per step on NVLink4) hide behind the matmuls with async TP but for 0.05 s (0.7% of the step)'."""
    s, p = c.setup, c.predicted
    share, total = tp_share(c)
    if s.async_tp:
        return (
            f"its collectives ({_s(total)} per step on {_link(req)}) hide behind the matmuls with async TP but for "
            f"{_s(p.tp_comm_exposed_s)} ({share:.1%} of the step)"
        )
    return f"its collectives {verb} {share:.1%} of the step on {_link(req)} ({_s(total)} of {_s(p.step_time_s)})"


def _tp_memory(req: PlanRequest, c: Candidate) -> tuple[str, bool]:
    """'frees 38.2 GiB of activations per GPU at micro-batch 8 (41.0 -> 2.8 GiB)', and whether the same setup without
    TP fits."""
    s = c.setup
    flat = replace(s, tp=1, async_tp=False)
    with_tp, without = activation_bytes(s, req), activation_bytes(flat, req)
    fits = mem.estimate(req.spec, flat).device_bytes <= req.capacity_bytes
    text = (
        f"frees {(without - with_tp) / GIB:.1f} GiB of activations per GPU at micro-batch {s.micro_batch_size} "
        f"({without / GIB:.1f} -> {with_tp / GIB:.1f} GiB, {ckpt_modes.label(s.checkpointing)})"
    )
    return text, fits


def _width(req: PlanRequest, c: Candidate, tp: int) -> float:
    """The matmul rate at tp over tp = 1 for c's micro-batch (Efficiency.tp_width_factor)."""
    tokens = c.setup.micro_batch_size * req.seq_len // c.setup.cp
    return req.efficiency.tp_width_factor(req.spec, tp, req.gpu, tokens, req.compute_dtype)


def _split(c: Candidate) -> str:
    q = c.predicted
    dp = q.comm_exposed_s - q.tp_comm_exposed_s - q.cp_comm_exposed_s
    ring = f" + {_s(q.cp_comm_exposed_s)} CP ring" if c.setup.cp > 1 else ""
    return f"{_s(q.compute_s)} compute + {_s(dp)} exposed data-parallel communication{ring}"


def table_rows(ranked: list[Candidate]) -> list[Candidate]:
    """One row per (tp, cp or not, strategy, nodes, recompute or not), best first: the best of selective / partial /
    full stands for checkpointing, the best cp degree for cp (rows per mode or degree would crowd out the
    strategies); memory_choice compares the modes, cp_choice the degrees."""
    rows: dict[tuple, Candidate] = {}
    for c in ranked:
        s = c.setup
        # under pp each schedule has its row (interleaved against 1f1b is the choice a person weighs)
        pp = (s.pp, str(s.pp_schedule)) if s.pp > 1 else ()
        rows.setdefault((s.tp, s.dims.cp_enabled, s.strategy, s.nodes, s.checkpointing != "none", *pp), c)
    return list(rows.values())


def explain_tp_choice(
    req: PlanRequest,
    chosen: Candidate,
    variants: list[Candidate],
    tps: list[int],
    pruned: dict[tuple[int, int], float] | None = None,
) -> str:
    """One sentence on tensor parallelism: why the chosen degree beat the best setup of the other kind (tp 1 against
    tp > 1), with the memory it frees and the share of the step its collectives take. `pruned`: (tp, cp) -> the
    bound of the families the planner did not search (llmctl.plan.search.parallel_bound)."""
    by_tp: dict[int, float] = {}
    for (tp, _), bound in (pruned or {}).items():
        if tp > 1:
            by_tp[tp] = max(by_tp.get(tp, 0.0), bound)
    pruned_tp = by_tp
    if tps == [1]:
        if req.pin("tp") == 1:
            return "tensor parallelism: pinned off (--tp 1)"
        problem = plan_problem(req.spec, 2) if req.gpus_per_node % 2 == 0 else None
        why = problem or f"no degree of 2, 4 or 8 divides the {req.gpus_per_node} GPUs per node"
        if req.pin("loss_chunk_tokens"):
            why = f"--loss-chunk {req.pin('loss_chunk_tokens')} (TP computes the loss on vocabulary shards, unchunked)"
        if req.finetune.adapters:
            why = f"{req.finetune.method} adapters run at tp 1 in llmctl's engine"
        return f"tensor parallelism: not considered: {why}"
    s = chosen.setup
    other = next((c for c in variants if (c.setup.tp > 1) != (s.tp > 1)), None)
    if s.tp > 1:
        freed, _ = _tp_memory(req, chosen)
        text = f"TP {s.tp}{' (async)' if s.async_tp else ''} {freed}; {_tp_costs(req, chosen)}"
        if other is None:
            return text + ("; no setup without TP fits" if req.pin("tp") is None else " (--tp pinned)")
        return text + f"; the best without TP ({_short(other)}) predicts {_gap(req, other, chosen)}"
    if other is None and pruned_tp:
        t, bound = max(pruned_tp.items(), key=lambda kv: kv[1])
        metric = "tokens/s" if req.objective == "throughput" else "tokens/s per GPU"
        p = chosen.predicted
        mine = p.tokens_per_s if req.objective == "throughput" else p.tokens_per_s_per_gpu
        return (
            f"tensor parallelism cannot win here: even without communication or recompute, TP {t} reaches at most "
            f"{bound:,.0f} {metric} (its matmuls at x{_width(req, chosen, t):.3f} "
            f"efficiency), below the chosen {mine:,.0f}"
        )
    if other is None:
        return f"tensor parallelism: no setup with TP {', '.join(str(t) for t in tps if t > 1)} fits"
    o = other.setup
    freed, flat_fits = _tp_memory(req, other)
    reasons = [
        f"its step is {_split(other)} + {_s(other.predicted.tp_comm_exposed_s)} TP (chosen: {_split(chosen)})",
        _tp_costs(req, other, "would cost"),
    ]
    width = _width(req, other, o.tp)
    if width < 0.995:
        reasons.append(f"its matmuls are 1/{o.tp} as wide (x{width:.3f} efficiency)")
    rep = fl.tp_replicated_flops_per_token(req.spec, req.seq_len)[0]
    if rep:
        share = rep / fl.model_flops_per_token(req.spec, req.seq_len)
        reasons.append(f"every TP rank runs and gathers the whole MoE blocks ({share:.0%} of the FLOPs)")
    reasons.append(freed + (", but that micro-batch fits without TP too" if flat_fits else ""))
    return f"TP {o.tp} lost: the best with TP ({_short(other)}) predicts {_gap(req, other, chosen)}; " + "; ".join(
        reasons
    )


# --- context parallelism -------------------------------------------------------------------------------------------
def _cp_ring(req: PlanRequest, c: Candidate) -> str:
    """'its ring moves K/V 1.23 s per step on NVLink4, 0.05 s of it exposed behind the attention (0.4% of the
    step)'."""
    p = c.predicted
    total = sum(o.time_per_step_s for o in p.comm_ops if o.phase == "cp")
    share = p.cp_comm_exposed_s / p.step_time_s if p.step_time_s else 0.0
    inside = req.gpus_per_node % (c.setup.cp * c.setup.tp) == 0
    link = _link(req) if inside else "the links between nodes"
    return (
        f"its {c.setup.cp_rotate} ring moves keys and values for {_s(total)} per step on {link}, "
        f"{_s(p.cp_comm_exposed_s)} of it not hidden by the attention ({share:.1%} of the step)"
    )


def _metric(req: PlanRequest, c: Candidate) -> float:
    p = c.predicted
    return p.tokens_per_s if req.objective == "throughput" else p.tokens_per_s_per_gpu


def explain_cp_choice(
    req: PlanRequest,
    chosen: Candidate,
    variants: list[Candidate],
    cps: list[int],
    pruned: dict[tuple[int, int], float] | None = None,
) -> str:
    """One sentence on context parallelism: why the chosen degree, with what one sequence's activations need per GPU
    without it and with it, what its ring costs, against the best setup of the other kind (cp 1 against cp > 1).
    `pruned`: (tp, cp) -> the bound of the families the planner did not search (llmctl.plan.planner.parallel_bound)."""
    s = chosen.setup
    if cps == [1]:
        if req.pin("cp") == 1:
            return "context parallelism: pinned off (--cp 1)"
        problem = cp_problem(req.spec, req.seq_len)
        if problem:
            why = problem
        elif req.nodes * req.gpus_per_node < 2:
            why = "one GPU"
        elif req.pin("attention") and not req.pin("attention").runs_ring:
            why = f"--attention {req.pin('attention')} (ring attention runs on SDPA)"
        else:
            why = f"no power of two splits seq len {req.seq_len} into 2cp head-tail chunks"
        return f"context parallelism: not considered: {why}"
    other = next((c for c in variants if (c.setup.cp > 1) != (s.cp > 1)), None)
    if s.cp > 1:
        flat = replace(s, cp=1)
        need, acts = mem.estimate(req.spec, flat).device_bytes, activation_bytes(flat, req)
        mine = activation_bytes(s, req)
        text = (
            f"CP {s.cp}: at {req.seq_len:,} tokens the activations of one sequence need {acts / GIB:.1f} GiB per GPU "
            f"({ckpt_modes.label(s.checkpointing)}, micro-batch {s.micro_batch_size}"
            + (f", TP {s.tp}" if s.tp > 1 else "")
            + f"; {need / GIB:.1f} GiB in all against {req.capacity_bytes / GIB:.1f} GiB); split {s.cp} ways, "
            f"{req.seq_len // s.cp:,} tokens per GPU, they need {mine / GIB:.1f} GiB "
            f"({chosen.predicted.memory_per_gpu_bytes / GIB:.1f} GiB in all, ring buffers included); {_cp_ring(req, chosen)}"
        )
        if other is None:
            return text + ("; no setup without CP fits" if req.pin("cp") is None else " (--cp pinned)")
        return text + f"; the best without CP ({_short(other)}) predicts {_gap(req, other, chosen)}"
    if other is None:
        if pruned:
            (tp, cp), bound = max(
                ((k, v) for k, v in pruned.items() if k[1] > 1), key=lambda kv: kv[1], default=((0, 0), 0)
            )
            if cp > 1:
                metric = "tokens/s" if req.objective == "throughput" else "tokens/s per GPU"
                return (
                    f"context parallelism cannot win here: with the least recompute that fits and no communication "
                    f"but its ring's, CP {cp}{f' x TP {tp}' if tp > 1 else ''} reaches at most {bound:,.0f} {metric} "
                    f"(ring attention on SDPA), below the chosen {_metric(req, chosen):,.0f}"
                )
        return f"context parallelism: no setup with CP {', '.join(str(c) for c in cps if c > 1)} fits"
    o = other.setup
    tp = f" (here with TP {s.tp})" if s.tp > 1 else ""
    reasons = [f"a whole {req.seq_len:,}-token sequence fits without it{tp}"]
    if s.attention != o.attention and attention_rates(req, s.attention) != attention_rates(req, o.attention):
        reasons.append(
            f"ring attention runs on {o.attention} ({attention_rates(req, o.attention)[0]}) where this setup runs "
            f"{s.attention} ({attention_rates(req, s.attention)[0]})"
        )
    reasons.append(_cp_ring(req, other))
    return f"CP {o.cp} lost: the best with CP ({_short(other)}) predicts {_gap(req, other, chosen)}; " + "; ".join(
        reasons
    )


# --- CPU offload -----------------------------------------------------------------------------------------------------
def offload_won(req: PlanRequest, without: Candidate, chosen: Candidate) -> str:
    """Why offload is on though a setup fits without it: 'on: the best setup without it (...) predicts 53% fewer
    tokens/s'."""
    return f"on: the best setup without it ({_short(without)}) predicts {_gap(req, without, chosen)}"


def explain_offload(req: PlanRequest, chosen: Candidate, why: str | None) -> str:
    """One sentence on CPU offload when the chosen setup has it: why (`why`; None: pinned), what the GPU and the
    host's memory hold, and what its copies and the host's work cost (llmctl.plan.offload). Empty when it is off."""
    s, p, off = chosen.setup, chosen.predicted, chosen.predicted.offload
    if not s.levers.offload or off is None:
        return ""
    est = mem.estimate(req.spec, mem.memory_key(s))
    why = why or "on as pinned (--offload)"
    cap = req.host_capacity_bytes
    room = (
        f" of {cap * s.gpus_per_node / GIB:,.0f} GiB"
        if cap is not None
        else " (not checked: the node's memory is not known; --cluster with node_memory_gib checks it)"
    )
    copies = s.grad_accum_steps * (off.host_to_device_s + off.device_to_host_s)
    link = req.gpu.host_link_gbytes_s
    return (
        f"{why}; each GPU holds the layers in flight and the activations "
        f"({p.memory_per_gpu_bytes / GIB:.1f} GiB), the host the parameters, gradients and optimizer states: "
        f"{est.host_node_bytes / GIB:,.0f} GiB per node ({est.host_bytes / GIB:.1f} GiB per GPU){room}; the copies "
        f"over the host link ({f'{link:g} GB/s PCIe, ' if link else ''}{off.host_link_gbytes_s:.3g} GB/s reached) take "
        f"{_s(copies)} per step, {_s(off.copies_exposed_s)} of it not hidden behind the compute, and the host's "
        f"gradient additions and AdamW step ({off.host_memory_gbytes_s:.3g} GB/s of memory bandwidth per GPU) "
        f"{_s(off.host_s)}: {p.offload_s / p.step_time_s:.0%} of the {_s(p.step_time_s)} step"
    )
