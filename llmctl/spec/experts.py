"""What an expert-parallel rank owns and sends (torch-free): the one place the engine, the memory model and the cost
model read expert parallelism from.

Layout (torchtitan's, parallelisms/expert_parallel.md and its ParallelDims): ep borrows its ranks from the
data-parallel x cp ranks of one replica (dp_shard x cp), consecutive ranks first, so an ep group is as close as the
mesh allows (inside a node while ep <= gpus_per_node / (tp x ...)). Each MoE layer's routed experts split evenly by
expert index over the ep group (rank e holds experts [e x E/ep, (e+1) x E/ep)); what is left of dp_shard x cp, the
`expert_shard` ("efsdp") ranks, FSDP-shards those local experts as data parallelism shards everything else. The router,
the shared experts, attention and the dense layers stay as they are (FSDP over dp_shard x cp).

A step of one MoE layer (dropless, as torchtitan's and Megatron's token-choice routers with no capacity factor):
each rank sends its tokens x top-k (token, expert) rows to the ranks holding those experts (the dispatch all-to-all),
the receiving rank runs its local experts as one grouped GEMM over the rows it got, and sends the results back (the
combine all-to-all). Balanced routing sends (ep - 1)/ep of a rank's rows away and receives as many; a rank whose
experts are popular receives more: `IMBALANCE` is the factor the memory and cost models assume, and say they assume.
"""

from __future__ import annotations

from dataclasses import dataclass

IMBALANCE = 1.0
"""Rows an ep rank receives, over the balanced share (tokens x top-k of one rank). 1.0: the balanced router that the
load-balancing loss (or DeepSeek-V3's bias) trains towards; the engine's `tokens per expert` metrics show the real
max/mean of a run. A capacity-free (dropless) router has no upper bound: the worst case is every row to one rank."""


@dataclass(frozen=True)
class ExpertShare:
    """One ep rank's part of one MoE layer."""

    experts: int
    """Routed experts of the layer (E)."""
    ep: int
    """Expert-parallel degree."""
    expert_shard: int
    """Ranks that FSDP-shard this rank's local experts (dp_shard x cp / ep)."""

    @property
    def local_experts(self) -> int:
        """Experts whose weights this rank holds (unsharded, in forward): E / ep."""
        return self.experts // self.ep

    def first_expert(self, ep_rank: int) -> int:
        """Index of the first local expert of `ep_rank`."""
        return ep_rank * self.local_experts

    def owner(self, expert: int) -> int:
        """The ep rank that holds `expert`."""
        return expert // self.local_experts

    @property
    def param_fraction(self) -> float:
        """Of the layer's routed-expert parameters, what one rank stores sharded: 1 / (ep x expert_shard)."""
        return 1.0 / (self.ep * self.expert_shard)


def share(experts: int, ep: int, expert_shard: int) -> ExpertShare:
    return ExpertShare(experts, ep, expert_shard)


def dispatch_rows(tokens: int, top_k: int, ep: int, imbalance: float = IMBALANCE) -> tuple[float, float]:
    """(rows sent to other ranks, rows received) by one ep rank in one dispatch (the combine moves the same back):
    a rank routes tokens x top_k rows; balanced, 1/ep of them stay on it; it receives `imbalance` x its share."""
    rows = tokens * top_k
    if ep <= 1:
        return 0.0, float(rows)
    return rows * (ep - 1) / ep, rows * imbalance


def ep_problem(num_experts: int, ep: int, name: str) -> str | None:
    """Why `ep` cannot split a model's routed experts (None if it can): a dense model, or an ep that does not divide
    the experts of every MoE layer."""
    if ep <= 1:
        return None
    if num_experts <= 0:
        return f"expert parallelism (ep {ep}) needs a mixture-of-experts model; {name} is dense"
    if num_experts % ep:
        return f"ep {ep} does not divide {name}'s {num_experts} routed experts"
    return None
