"""bench-net's slow-node rules: which nodes or links fall below the others, and the pairwise test rounds
(torch-free). The report schema and bandwidth math are llmctl.spec.bench."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from llmctl.spec.bench import LinkResult, NodeVerdict

# ---------------------------------------------------------------------------------------------- slow nodes


def below_median(values: dict[str, float], fraction: float) -> list[str]:
    """Keys whose value is below `fraction` x the median of all values. Needs 3 values or more: with two there
    is no majority to tell which one is off (the median is their mean), so nothing is flagged."""
    if len(values) < 3:
        return []
    ref = statistics.median(values.values())
    return [k for k, v in values.items() if v < fraction * ref]


def judge_nodes(
    node_names: Iterable[str],
    links: Sequence[LinkResult],
    intra_busbw: dict[str, float],
    fraction: float,
) -> tuple[list[LinkResult], list[NodeVerdict]]:
    """Flag slow links and nodes.

    A node's link score is the best busbw among its pairwise links: one bad node drags down every link it is on
    (so with 3 nodes the median *link* is already a bad one), but a healthy node has at least one good link.
    A node is slow if that score is below `fraction` x the median node score, or if its intra-node busbw is
    below `fraction` x the median intra-node busbw; a link is slow if it is below `fraction` x the median node
    score. Two nodes are never flagged (see `below_median`): compare them with --expect-gbps instead.
    """
    names = list(node_names)
    best: dict[str, float] = {}
    for lk in links:
        for n in (lk.a, lk.b):
            best[n] = max(best.get(n, 0.0), lk.busbw_gbytes_s)
    ref = statistics.median(best.values()) if best else 0.0
    slow_by_link = set(below_median(best, fraction))
    slow_by_intra = set(below_median(intra_busbw, fraction))
    judged_links = [
        lk.model_copy(update={"slow": len(best) >= 3 and lk.busbw_gbytes_s < fraction * ref}) for lk in links
    ]
    verdicts = []
    for n in names:
        reasons = []
        if n in slow_by_link:
            reasons.append(f"best inter-node link {best[n]:.3g} GB/s < {fraction:g} x median {ref:.3g} GB/s")
        if n in slow_by_intra:
            med = statistics.median(intra_busbw.values())
            reasons.append(f"intra-node busbw {intra_busbw[n]:.3g} GB/s < {fraction:g} x median {med:.3g} GB/s")
        verdicts.append(
            NodeVerdict(
                name=n,
                best_link_busbw_gbytes_s=best.get(n),
                intra_busbw_gbytes_s=intra_busbw.get(n),
                slow=bool(reasons),
                reason="; ".join(reasons) or None,
            )
        )
    return judged_links, verdicts


def round_robin_pairs(k: int) -> list[list[tuple[int, int]]]:
    """All pairs of k nodes in k-1 (k even) or k (k odd) rounds of disjoint pairs (the circle method), so that
    the pairs of one round can run at the same time without sharing a node."""
    idx: list[int | None] = list(range(k)) + ([None] if k % 2 else [])
    m = len(idx)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for i in range(m // 2):
            a, b = idx[i], idx[m - 1 - i]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(pairs)
        idx = [idx[0], idx[-1], *idx[1:-1]]
    return rounds
