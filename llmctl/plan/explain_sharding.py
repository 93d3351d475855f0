"""FULL vs HYBRID, the question llmctl was made to answer (docs/sources.md#fsdp-seed), answered in every multi-node
plan: the best setup of each strategy, which won and why the other lost (torch-free).

FULL_SHARD splits each replica's states over every data-parallel rank, so its all-gathers and reduce-scatters cross
the nodes' network; HYBRID_SHARD splits them inside a node and replicates across nodes, so only an all-reduce of each
shard crosses it, and each GPU holds a node's share of the states, not the cluster's. Which wins depends on the
network, the model and the memory left for activations: the sentence names the figure that decided it.
"""

from __future__ import annotations

import re

from llmctl.plan.explain import why_lost
from llmctl.plan.ranking import sort_key
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import Candidate
from llmctl.spec import checkpointing as ckpt_modes

PAIR = ("full_shard", "hybrid_shard")
NEEDS = re.compile(r"needs ([0-9.]+) GiB per GPU")
"""A dropped line's memory (llmctl.plan.search.MemorySearch.micro_batches): the least needed is the closest to fitting."""
NAME = {"full_shard": "FULL_SHARD", "hybrid_shard": "HYBRID_SHARD"}


def explain_sharding(req: PlanRequest, chosen: Candidate, variants: list[Candidate], rejected: list[str]) -> str:
    """'HYBRID_SHARD wins: ...; FULL_SHARD's best, ...: 0.45 s/step exposed communication (...) vs 0.10 s; 7% fewer
    tokens/s' for a request of two nodes or more (empty on one node, where hybrid is full_shard). `variants`: every
    setup the search kept, best first; where one strategy has none, why (its pin, or the first reason the search
    dropped it for)."""
    if req.nodes < 2:
        return ""
    best: dict[str, Candidate] = {}
    for c in variants:
        if c.setup.strategy in PAIR:
            best.setdefault(c.setup.strategy, c)
    if len(best) == 2:
        win, lose = sorted(best.values(), key=lambda c: sort_key(req, c))
        which = "the chosen setup" if win.setup == chosen.setup else f"its best, {_short(win)}"
        head = f"{NAME[win.setup.strategy]} wins with {_tps(req, win)} ({which})"
        if chosen.setup.strategy not in PAIR:
            head = f"neither is chosen ({chosen.setup.strategy.upper()} is faster); {head}"
        return f"{head}; {NAME[lose.setup.strategy]}'s best, {why_lost(lose, win, req)}"
    absent = [s for s in PAIR if s not in best]
    parts = [f"{NAME[s]}: {_absent(req, s, rejected)}" for s in absent]
    if best:
        (one,) = best.values()
        parts.insert(0, f"{NAME[one.setup.strategy]}'s best: {_short(one)} with {_tps(req, one)}")
    return "; ".join(parts)


def _short(c: Candidate) -> str:
    s = c.setup
    return f"{c.label}, mb {s.micro_batch_size} x {s.grad_accum_steps}, {ckpt_modes.label(s.checkpointing)}"


def _tps(req: PlanRequest, c: Candidate) -> str:
    p = c.predicted
    if req.objective == "cost":
        return f"{p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
    return f"{p.tokens_per_s:,.0f} tokens/s on {c.setup.gpus} GPUs"


def _absent(req: PlanRequest, strategy: str, rejected: list[str]) -> str:
    """Why no setup of `strategy` was kept: pinned away, or of the lines the search dropped it with the one closest to
    fitting (the least memory needed), else the first; else the layout that rules it out."""
    pinned = req.pin("strategy")
    if pinned and pinned != strategy:
        return f"not searched (--strategy {pinned})"
    mine = [line for line in rejected if line.split(" ", 1)[0] == strategy or line.startswith(f"--strategy {strategy}")]
    sized = [(float(m.group(1)), line) for line in mine if (m := NEEDS.search(line))]
    if sized:
        return f"none fits; the closest: {min(sized)[1]}"
    if mine:
        return f"none kept ({mine[0]})"
    if strategy == "hybrid_shard":
        return (
            f"no setup: a shard group of a node's {req.gpus_per_node} GPUs over tp x cp must leave 2 ranks or more "
            "and the data-parallel ranks must hold 2 replicas or more"
        )
    return "no setup fits or splits the global batch"
