"""Why expert parallelism won or lost (torch-free): the chosen setup against the best of the other kind (ep > 1
against ep 1), in the terms that decide it (llmctl.plan.experts): the experts a GPU gathers, the grouped GEMMs'
matmul time against the expert loop's, and the all-to-alls' share of the step, with the load imbalance assumed."""

from __future__ import annotations

from dataclasses import replace

from llmctl.plan import experts as ex
from llmctl.plan.memory.experts import expert_memory
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import Candidate
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.setup import TrainSetup
from llmctl.units import GIB


def experts_held(req: PlanRequest, setup: TrainSetup) -> str:
    """'experts 7.9 GiB per GPU instead of 63 (16 local experts of 128, FSDP over 4)': the routed experts' states and
    unsharded copies on one GPU (llmctl.plan.memory.experts.expert_memory) against the same setup at ep 1."""
    mine = expert_memory(req.spec, setup)
    at_1 = expert_memory(req.spec, replace(setup, ep=1))
    fsdp = f", FSDP over {setup.dims.expert_shard}" if setup.dims.expert_shard > 1 else ""
    return (
        f"experts {mine.total_bytes / GIB:.1f} GiB per GPU instead of {at_1.total_bytes / GIB:.1f} "
        f"({mine.local_experts} local experts of {mine.experts}{fsdp})"
    )


def _gap(req: PlanRequest, loser: Candidate, winner: Candidate) -> str:
    if req.objective == "cost":
        a, b = loser.predicted.tokens_per_s_per_gpu, winner.predicted.tokens_per_s_per_gpu
        return f"{(b / a - 1 if a else 0):.1%} more cost per token"
    a, b = loser.predicted.tokens_per_s, winner.predicted.tokens_per_s
    return f"{(1 - a / b if b else 0):.1%} fewer tokens/s"


def _short(c: Candidate) -> str:
    s = c.setup
    return f"{c.label}, mb {s.micro_batch_size} x {s.grad_accum_steps}, {ckpt_modes.label(s.checkpointing)}"


def ep_costs(req: PlanRequest, c: Candidate) -> str:
    """'its all-to-alls cost 0.38 s, 4.5% of the step (564 a step of 256 MiB each, inside a node at 352 GB/s; all
    exposed, routing assumed balanced: imbalance 1.0)'."""
    s, p = c.setup, c.predicted
    a2a = [o for o in p.comm_ops if o.phase == "ep"]
    secs = ex.alltoall_seconds(p.comm_ops)
    calls = sum(o.calls_per_step for o in a2a)
    size = a2a[0].bytes_per_call if a2a else 0.0
    g = s.gpus_per_node
    where = "inside a node" if s.ep <= g else f"over {s.ep // g} nodes"
    rate = f" at {a2a[0].busbw_gbytes_s:.3g} GB/s" if a2a else ""
    share = secs / p.step_time_s if p.step_time_s else 0.0
    return (
        f"its all-to-alls cost {secs:.2f} s, {share:.1%} of the step ({calls} a step of {size / 2**20:,.0f} MiB each, "
        f"{where}{rate}; none hidden, routing assumed balanced: imbalance {ex.IMBALANCE:.2f})"
    )


def _versus(req: PlanRequest, with_ep: Candidate, without: Candidate) -> str:
    """The trade in numbers: matmul seconds (grouped GEMMs against the expert loop) and the other exposed
    communication (FSDP's, with E/ep experts gathered)."""
    mm_e, mm_o = with_ep.predicted.split.get("matmul", 0.0), without.predicted.split.get("matmul", 0.0)
    dp_e = with_ep.predicted.comm_exposed_s - ex.alltoall_seconds(with_ep.predicted.comm_ops)
    return (
        f"matmuls {mm_e:.2f} s (grouped GEMMs) vs {mm_o:.2f} s (the expert loop); other exposed communication "
        f"{dp_e:.2f} s vs {without.predicted.comm_exposed_s:.2f} s"
    )


def explain_ep_choice(req: PlanRequest, chosen: Candidate, variants: list[Candidate], eps: list[int]) -> str:
    """One sentence on expert parallelism: why the chosen setup has it or not, against the best of the other kind,
    with the experts it gathers, its matmul time and its all-to-alls' share of the step. Empty where the search did
    not consider it (a dense model, or ep pinned to 1)."""
    s = chosen.setup
    if eps == [1]:
        return "expert parallelism: pinned off (--ep 1)" if req.pin("ep") == 1 else ""
    other = next((c for c in variants if (c.setup.ep > 1) != (s.ep > 1)), None)
    if s.ep > 1:
        text = f"EP {s.ep}: {experts_held(req, s)}; {ep_costs(req, chosen)}"
        if other is None:
            return text + ("; no setup without EP fits" if req.pin("ep") is None else " (--ep pinned)")
        return f"{text}; {_versus(req, chosen, other)}; the best without EP ({_short(other)}) predicts {_gap(req, other, chosen)}"
    if other is None:
        return f"expert parallelism: no setup with EP {', '.join(str(e) for e in eps if e > 1)} fits or runs here"
    o = other.setup
    return (
        f"EP {o.ep} lost: the best with EP ({_short(other)}) predicts {_gap(req, other, chosen)}; "
        f"{experts_held(req, o)}; {ep_costs(req, other)}; {_versus(req, other, chosen)}"
    )
