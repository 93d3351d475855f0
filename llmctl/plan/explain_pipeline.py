"""Why pipeline parallelism won or lost (torch-free): the chosen setup against the best of the other kind (pp > 1
against pp 1), in the terms that decide it: the schedule's bubble, the sends between stages and the link they
cross, the data-parallel communication a stage's smaller FSDP group saves, and the model states a GPU holds."""

from __future__ import annotations

from dataclasses import replace

from llmctl.plan import memory as mem
from llmctl.plan import stages
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import Candidate, pipeline_label
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.setup import TrainSetup
from llmctl.units import GIB


def states_bytes(req: PlanRequest, setup: TrainSetup) -> int:
    """Bytes per GPU of model states (parameters, gradients, optimizer states: the memory model's components counted
    per parameter)."""
    return sum(c.bytes for c in mem.estimate(req.spec, setup).components if c.bytes_per_param is not None)


def without_pp(setup: TrainSetup) -> TrainSetup:
    """The same setup with its pipeline folded into data parallelism (pp 1: the stage's ranks join the FSDP group)."""
    return replace(setup, pp=1, pp_schedule="1f1b", pp_virtual_stages=None, pp_microbatches=None)


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "0%"


def pipeline_costs(req: PlanRequest, c: Candidate) -> str:
    """'bubble 4.7% of the step (2.05 s), sends between stages 0.31 s exposed (7 hops, 7 between nodes, at
    50 GB/s)'."""
    s, p = c.setup, c.predicted
    inside, across = stages.hops(s.dims, s.gpus_per_node)
    send = next((o for o in p.comm_ops if o.phase == "p2p"), None)
    rate = f" at {send.busbw_gbytes_s:.3g} GB/s" if send is not None else ""
    n = inside + across
    where = f"{across} between nodes" if across else ("inside a node" if n == 1 else "all inside a node")
    return (
        f"bubble {_pct(p.bubble_s, p.step_time_s)} of the step ({p.bubble_s:.2f} s), sends between stages "
        f"{p.p2p_comm_exposed_s:.2f} s exposed ({n} hop{'s' if n > 1 else ''}, {where}{rate})"
    )


def _dp_comm(c: Candidate) -> float:
    p = c.predicted
    return p.comm_exposed_s - p.tp_comm_exposed_s - p.cp_comm_exposed_s - p.p2p_comm_exposed_s


def _short(c: Candidate) -> str:
    s = c.setup
    return f"{c.label}, mb {s.micro_batch_size} x {s.grad_accum_steps}, {ckpt_modes.label(s.checkpointing)}"


def _gap(req: PlanRequest, loser: Candidate, winner: Candidate) -> str:
    if req.objective == "cost":
        a, b = loser.predicted.tokens_per_s_per_gpu, winner.predicted.tokens_per_s_per_gpu
        return f"{(b / a - 1 if a else 0):.1%} more cost per token"
    a, b = loser.predicted.tokens_per_s, winner.predicted.tokens_per_s
    return f"{(1 - a / b if b else 0):.1%} fewer tokens/s"


def _versus(req: PlanRequest, piped: Candidate, flat: Candidate) -> str:
    """The trade in numbers: states per GPU, exposed data-parallel communication and compute of each."""
    held, folded = states_bytes(req, piped.setup), states_bytes(req, without_pp(piped.setup))
    if folded - held > GIB / 10:
        states = f"frees {(folded - held) / GIB:.1f} GiB of states per GPU ({folded / GIB:.1f} -> {held / GIB:.1f} GiB)"
    else:
        states = f"holds {held / GIB:.1f} GiB of states per GPU, as its sharding does without PP"
    return (
        f"{states}; data-parallel communication {_dp_comm(piped):.2f} s exposed vs {_dp_comm(flat):.2f} s without "
        f"PP; compute {piped.predicted.compute_s - piped.predicted.bubble_s:.2f} s + bubble vs "
        f"{flat.predicted.compute_s:.2f} s ({ckpt_modes.label(piped.setup.checkpointing)} vs "
        f"{ckpt_modes.label(flat.setup.checkpointing)}, micro-batch {piped.setup.micro_batch_size} vs "
        f"{flat.setup.micro_batch_size})"
    )


def explain_pp_choice(
    req: PlanRequest, chosen: Candidate, variants: list[Candidate], pps: list[int], pruned: dict[tuple[int, int], float]
) -> str:
    """One sentence on pipeline parallelism: why the chosen setup has it or not, against the best of the other kind,
    with its bubble, its sends, what it frees and what it saves. Empty where the search did not consider it."""
    s = chosen.setup
    if pps == [1]:
        return "pipeline parallelism: pinned off (--pp 1)" if req.pin("pp") == 1 else ""
    other = next((c for c in variants if (c.setup.pp > 1) != (s.pp > 1)), None)
    if s.pp > 1:
        text = f"PP {s.pp} {pipeline_label(s)}: {pipeline_costs(req, chosen)}"
        if other is None:
            return text + ("; no setup without PP fits" if req.pin("pp") is None else " (--pp pinned)")
        return f"{text}; {_versus(req, chosen, other)}; the best without PP ({_short(other)}) predicts {_gap(req, other, chosen)}"
    if other is None:
        if pruned:
            (_, pp), bound = max(pruned.items(), key=lambda kv: kv[1])
            metric = "tokens/s" if req.objective == "throughput" else "tokens/s per GPU"
            return (
                f"pipeline parallelism cannot win here: even without communication or recompute and with the least "
                f"bubble, PP {pp} reaches at most {bound:,.0f} {metric}"
            )
        return f"pipeline parallelism: no setup with PP {', '.join(str(p) for p in pps if p > 1)} fits"
    o = other.setup
    return (
        f"PP {o.pp} lost: the best with PP ({_short(other)}) predicts {_gap(req, other, chosen)}; "
        f"{pipeline_costs(req, other)}; {_versus(req, other, chosen)}"
    )
