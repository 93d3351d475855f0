"""The preflight's decision, pure: which nodes train, from the node checks and the quick bench across the nodes that
passed; which are dropped and why; when the job stops, and which nodes a requeue should leave out."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmctl.spec.bench import BenchReport
    from llmctl.spec.planfile import Plan

SLOW_FRACTION = 0.7
"""bench-net's --slow-fraction default: a node, link or figure below 0.7 x its reference is slow."""


@dataclass(frozen=True)
class NodeCheck:
    """One node's result of the node step (what llmctl.netbench.quick writes), or why there is none."""

    node: str
    ok: bool
    error: str | None = None
    device: str | None = None
    ranks: int | None = None
    intra_busbw_gbytes_s: float | None = None
    """The all-reduce among the node's ranks (None with one rank per node)."""
    seconds: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeCheck:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Assumed:
    """What the plan assumed that the preflight can measure (None: the plan does not say)."""

    intra_busbw_gbytes_s: float | None = None
    """Bus bandwidth per GPU inside a node, GB/s."""
    inter_node_busbw_gbytes_s: float | None = None
    """Bus bandwidth per node across nodes (all its NICs together), GB/s."""


def plan_assumptions(plan: Plan) -> Assumed:
    """The bandwidth the plan's prediction used (`predicted.intra_node_busbw_gbytes_s` and
    `inter_node_busbw_gbytes_s`, written by `llmctl plan`). A hand-written plan without them: only the node checks
    and the slow-node rules apply."""
    p = plan.predicted
    return Assumed(
        intra_busbw_gbytes_s=p.intra_node_busbw_gbytes_s,
        inter_node_busbw_gbytes_s=p.inter_node_busbw_gbytes_s,
    )


@dataclass
class Decision:
    allocated: list[str]
    needed: int
    train: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    """node -> why, in the order they were dropped."""
    warnings: list[str] = field(default_factory=list)
    failure: str | None = None
    """One line: why the job stops (None: it trains on `train`)."""
    exclude: list[str] = field(default_factory=list)
    """The failed or slow nodes that left too few: a requeue without them may run (`requeue_without`)."""
    measured: dict[str, float] = field(default_factory=dict)
    """The figures compared with the plan (GB/s)."""
    assumed: Assumed = field(default_factory=lambda: Assumed())
    """What they were compared with."""

    @property
    def ok(self) -> bool:
        return self.failure is None


def gbps(gbytes_s: float) -> str:
    """A bandwidth in the log: GB/s, and Gbit/s as NICs are sold."""
    return f"{gbytes_s:.3g} GB/s ({gbytes_s * 8:.3g} Gbit/s)"


def nodelist(nodes: list[str]) -> str:
    """Node names as SLURM's --nodelist and --exclude take them."""
    return ",".join(nodes)


def _node_score(node: str, checks: dict[str, NodeCheck], bench: BenchReport | None) -> tuple[float, float]:
    """Higher is better: the node's best pairwise link, then its intra-node all-reduce (inf when unmeasured, so
    that an unmeasured figure never makes a node look worst)."""
    link = intra = float("inf")
    if bench is not None:
        v = next((v for v in bench.node_verdicts if v.name == node), None)
        if v is not None and v.best_link_busbw_gbytes_s is not None:
            link = v.best_link_busbw_gbytes_s
    c = checks.get(node)
    if c is not None and c.intra_busbw_gbytes_s is not None:
        intra = c.intra_busbw_gbytes_s
    return link, intra


def decide(
    allocated: list[str],
    needed: int,
    checks: dict[str, NodeCheck],
    bench: BenchReport | None = None,
    cross_error: str | None = None,
    assumed: Assumed = Assumed(),
    strict: bool = False,
    fraction: float = SLOW_FRACTION,
) -> Decision:
    """Which nodes train, from the node checks and the quick bench across the nodes that passed. Pure."""
    from llmctl.netbench.report import below_median

    d = Decision(allocated=list(allocated), needed=needed, assumed=assumed)
    spares = len(allocated) - needed
    for n in allocated:
        c = checks.get(n)
        if c is None or not c.ok:
            d.dropped[n] = f"failed: {c.error if c is not None and c.error else 'no answer'}"
    failed = list(d.dropped)
    healthy = [n for n in allocated if n not in d.dropped]

    def stop(why: str, nodes: list[str]) -> Decision:
        fix = f"relaunch with {nodelist(nodes)} in --exclude"
        if spares < len(nodes):
            fix += f", or with --spare-nodes {len(nodes)}"
        left = len(allocated) - len(d.dropped)
        d.failure = f"{why}; {left} of {len(allocated)} nodes left, the plan needs {needed} ({fix})"
        d.exclude = list(nodes)
        return d

    if len(healthy) < needed:
        return stop("; ".join(f"{n} {d.dropped[n]}" for n in failed), failed)
    if cross_error is not None:
        d.failure = f"the all-reduce across {nodelist(healthy)} failed: {cross_error}"
        return d

    # Slow by bench-net's rules: its verdicts across nodes (best pairwise link, intra-node inside the bench), and
    # the same median rule on the node step's intra-node all-reduce (measured on every node at the same time).
    slow: dict[str, str] = {}
    if bench is not None:
        slow.update({v.name: v.reason or "slow" for v in bench.node_verdicts if v.slow and v.name in healthy})
    intra = {n: checks[n].intra_busbw_gbytes_s for n in healthy if checks[n].intra_busbw_gbytes_s is not None}
    if intra:
        med = statistics.median(intra.values())
        for n in below_median(intra, fraction):  # type: ignore[arg-type]
            why = f"intra-node all-reduce {intra[n]:.3g} GB/s < {fraction:g} x median {med:.3g} GB/s"
            slow[n] = f"{slow[n]}; {why}" if n in slow else why
    for n in healthy:
        if n in slow:
            d.dropped[n] = f"slow: {slow[n]}"
    keep = [n for n in healthy if n not in slow]
    if len(keep) < needed:
        named = [n for n in healthy if n in slow]
        return stop("; ".join(f"{n} {d.dropped[n]}" for n in failed + named), failed + named)

    # More than needed (spares): leave out the worst, the latest in the allocation on a tie.
    while len(keep) > needed:
        worst = min(reversed(keep), key=lambda n: _node_score(n, checks, bench))
        link, intra_bw = _node_score(worst, checks, bench)
        measured = [f"best link {link:.3g} GB/s"] if link != float("inf") else []
        measured += [f"intra-node {intra_bw:.3g} GB/s"] if intra_bw != float("inf") else []
        d.dropped[worst] = "spare, the worst of the rest" + (f": {', '.join(measured)}" if measured else "")
        keep.remove(worst)
    d.train = keep

    # Bandwidth against the plan's assumption (per GPU inside a node, per node across nodes).
    below = []
    if intra:
        got = statistics.median(intra[n] for n in keep if n in intra) if any(n in intra for n in keep) else None
        if got is not None:
            d.measured["intra_busbw_gbytes_s"] = got
            if assumed.intra_busbw_gbytes_s and got < fraction * assumed.intra_busbw_gbytes_s:
                below.append(
                    f"intra-node all-reduce busbw {gbps(got)} per GPU, {got / assumed.intra_busbw_gbytes_s:.2f} x "
                    f"the plan's {gbps(assumed.intra_busbw_gbytes_s)}"
                )
    if bench is not None and len(bench.nodes) > 1:
        got = bench.inter_node_busbw_gbytes_s(bench.config.sizes_bytes[0], per_node=True)
        if got is not None:
            d.measured["inter_node_busbw_gbytes_s"] = got
            if assumed.inter_node_busbw_gbytes_s and got < fraction * assumed.inter_node_busbw_gbytes_s:
                below.append(
                    f"inter-node all-reduce busbw {gbps(got)} per node, "
                    f"{got / assumed.inter_node_busbw_gbytes_s:.2f} x the plan's {gbps(assumed.inter_node_busbw_gbytes_s)}"
                )
    if below and strict:
        d.failure = "; ".join(below) + " (--preflight-strict; the plan's prediction will not hold)"
    else:
        d.warnings += [f"{b}: the run will be slower than the plan predicts" for b in below]
    return d


def summary(d: Decision) -> str:
    """The events-file line (without the keyword, time and restart) for a job that goes on."""
    out = f"training on {nodelist(d.train)}"
    if d.dropped:
        out += "; dropped " + "; ".join(f"{n} ({why})" for n, why in d.dropped.items())
    return out
