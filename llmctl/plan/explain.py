"""Why the planner chose what it chose: what a setup's recompute costs, what the other checkpointing modes would fit
and cost, and one sentence per losing setup (torch-free)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import Candidate, compute_times, evaluate
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.setup import TrainSetup

if TYPE_CHECKING:
    from llmctl.plan.planner import MemorySearch


def sort_key(req: PlanRequest, c: Candidate) -> tuple[float, float]:
    """Best first: most tokens/s (throughput), or most tokens/s per GPU (cost per token = GPUs x price / tokens/s)."""
    p = c.predicted
    if req.objective == "cost":
        return (-p.tokens_per_s_per_gpu, -p.tokens_per_s)
    return (-p.tokens_per_s, -p.tokens_per_s_per_gpu)


def recompute_cost(req: PlanRequest, setup: TrainSetup) -> float:
    """Extra compute time per micro-batch that the setup's checkpointing and chunked loss add (0.19 = 19% more)."""
    base = sum(compute_times(req, replace(setup, checkpointing="none", loss_chunk_tokens=0))[1:])
    mine = sum(compute_times(req, setup)[1:])
    return mine / base - 1 if base else 0.0


def recompute_seconds(req: PlanRequest, setup: TrainSetup) -> float:
    """Backward seconds of one single-sequence micro-batch without compile: orders setups by their recompute (it
    scales with the tokens, so the order holds at every micro-batch)."""
    return compute_times(req, replace(setup, micro_batch_size=1, compile=False))[2]


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
        for chunk in chunks:
            for mb in search.micro_batches(s.strategy, s.nodes, mode, s.attention, chunk, per_gpu, rejected=[]):
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
    if s.attention != b.attention:
        causes.append(
            f"{s.attention} attention runs at {req.efficiency.kernel[s.attention]:.0%} of peak vs "
            f"{req.efficiency.kernel[b.attention]:.0%} for {b.attention}"
        )
    if b.compile and not s.compile:
        causes.append("no torch.compile")
    if s.gpus < b.gpus:
        causes.append(f"uses {s.gpus} GPUs vs {b.gpus}")
    if not causes and s.micro_batch_size < b.micro_batch_size:
        causes.append(f"smaller micro-batch ({s.micro_batch_size} vs {b.micro_batch_size})")
    detail = ", ".join(causes) or "slower compute"
    return f"{name}: compute {p.compute_s:.2f} s/step vs {bp.compute_s:.2f} s ({detail}); {pct}"
