"""How the planner ranks (torch-free): candidates best first by the request's objective, and the options of a family
(checkpointing x loss chunk) by what their recompute costs."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from llmctl.plan.timing import compute_times

if TYPE_CHECKING:
    from llmctl.plan.request import PlanRequest
    from llmctl.plan.timing import Candidate
    from llmctl.spec.setup import TrainSetup


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
    return compute_times(req, replace(setup, micro_batch_size=1, compile=False, async_tp=False))[2]
