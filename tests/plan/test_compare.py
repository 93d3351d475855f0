"""`plan --compare`'s search (llmctl.plan.compare) against a brute force over every kind and count, and its deadline
and budget filters."""

from __future__ import annotations

import datetime
import math

import pytest

from llmctl.plan import compare as cmp
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.prices import PriceQuote

MODEL = "llama-3.2-1b"
KINDS = ["A100-80GB", "H100-SXM", "L4"]
PRICES = {"A100-80GB": 1.9, "H100-SXM": 3.1, "L4": 0.55}
MAX_GPUS = 64
OPTIONS = {**cmp.PLAN_OPTIONS, "tokens": "20B"}
SEQ = {"seq_len": 2048}
"""The decisions every comparison here is made with."""


class FakePrices:
    """A price table with fixed figures (quote() is all compare reads)."""

    def __init__(self, prices: dict[str, float]) -> None:
        self.prices = prices

    def quote(self, gpu: str, basis: str) -> PriceQuote | None:
        usd = self.prices.get(resolve_gpu(gpu).name)
        return None if usd is None else PriceQuote(usd, basis, "test", datetime.date(2026, 1, 1), "")


def run(ask: cmp.Ask, prices: dict[str, float] = PRICES) -> cmp.Comparison:
    kinds = [resolve_gpu(k) for k in KINDS]
    return cmp.compare(MODEL, OPTIONS, SEQ, kinds, ask, FakePrices(prices))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def every_point() -> dict[str, list[cmp.Point]]:
    """Brute force: the planner at every count of every kind (what the comparison's search must agree with)."""
    make = cmp.requests_from(MODEL, OPTIONS, SEQ)
    out = {}
    for k in KINDS:
        g = resolve_gpu(k)
        net = cmp.default_interconnect(g)
        quote = FakePrices(PRICES).quote(k, "on-demand")
        out[k] = [cmp.probe(make, g, n, g.node_gpus, net, quote) for n in cmp.gpu_counts(g.node_gpus, MAX_GPUS)]
    return out


def brute_force(points: dict[str, list[cmp.Point]], tokens: int, deadline_s: float | None) -> dict[str, cmp.Point]:
    """Per kind, the cheapest point that finishes within the deadline (ties: fewer GPUs)."""
    best = {}
    for k, pts in points.items():
        ok = [p for p in pts if p.candidate and (deadline_s is None or (p.seconds(tokens) or math.inf) <= deadline_s)]
        if ok:
            best[k] = min(ok, key=lambda p: (p.gpu_hours(tokens), p.gpus))
    return best


def test_gpu_counts() -> None:
    assert cmp.gpu_counts(8, 64) == [1, 2, 4, 8, 16, 32, 64]
    assert cmp.gpu_counts(4, 16) == [1, 2, 4, 8, 16]
    assert cmp.gpu_counts(72, 300) == [1, 2, 4, 8, 16, 32, 64, 72, 144, 288]
    assert cmp.gpu_counts(8, 4) == [1, 2, 4, 8]  # at least one node


@pytest.mark.parametrize("deadline_days", [None, 2.0, 0.5])
def test_picks_match_brute_force(every_point: dict[str, list[cmp.Point]], deadline_days: float | None) -> None:
    tokens = 20 * 10**9
    deadline = deadline_days * cmp.DAY if deadline_days else None
    ask = cmp.Ask(tokens, deadline, max_gpus=MAX_GPUS)
    got = run(ask)
    want = brute_force(every_point, tokens, deadline)
    for row in got.rows:
        k = row.gpu.name
        if k in want:
            assert row.excluded is None, row.excluded
            assert row.pick is not None and row.pick.gpus == want[k].gpus, (k, [p.gpus for p in row.points])
            assert row.pick.candidate.predicted.tokens_per_s == pytest.approx(want[k].candidate.predicted.tokens_per_s)
        else:
            assert row.excluded and "cannot meet the deadline" in row.excluded
    # the cheapest kind overall, and its cost: GPUs x hours x price
    costs = {k: p.gpu_hours(tokens) * PRICES[k] for k, p in want.items()}
    assert got.cheapest is not None and got.cheapest.gpu.name == min(costs, key=costs.__getitem__)
    cheapest = got.cheapest.pick
    assert cheapest.cost(tokens, got.cheapest.price) == pytest.approx(min(costs.values()))
    secs = {k: p.seconds(tokens) for k, p in want.items()}
    assert got.fastest is not None and got.fastest.gpu.name == min(secs, key=secs.__getitem__)
    d = got.as_dict()
    assert d["cheapest"] == got.cheapest.gpu.name and d["fastest"] == got.fastest.gpu.name
    row = next(r for r in d["comparison"] if r["gpu"] == d["cheapest"])
    assert row["cost_usd"] == pytest.approx(min(costs.values()))
    assert row["days"] == pytest.approx(secs[d["cheapest"]] / cmp.DAY)
    assert row["gpus"] == want[d["cheapest"]].gpus and row["excluded"] is None


def test_fewest_that_fit_is_the_smallest_count_that_fits(every_point: dict[str, list[cmp.Point]]) -> None:
    got = run(cmp.Ask(20 * 10**9, max_gpus=MAX_GPUS))
    for row in got.rows:
        first = next(p for p in every_point[row.gpu.name] if p.candidate)
        assert row.fewest_gpus == first.gpus


def test_deadline_nobody_meets_excludes_every_row() -> None:
    got = run(cmp.Ask(20 * 10**9, 60.0, max_gpus=MAX_GPUS))  # a minute for 20B tokens
    assert all(r.excluded and r.excluded.startswith("cannot meet the deadline") for r in got.rows)
    assert got.cheapest is None and got.fastest is None
    assert "no row" in got.why_fastest


def test_budget_excludes_rows_over_it_and_rows_without_a_price(every_point: dict[str, list[cmp.Point]]) -> None:
    tokens = 20 * 10**9
    want = brute_force(every_point, tokens, None)
    costs = sorted((p.gpu_hours(tokens) * PRICES[k], k) for k, p in want.items())
    budget = (costs[0][0] + costs[1][0]) / 2  # only the cheapest stays
    got = run(cmp.Ask(tokens, budget_usd=budget, max_gpus=MAX_GPUS), {**PRICES, "L4": None})  # type: ignore[dict-item]
    kept = [r.gpu.name for r in got.rows if r.excluded is None]
    assert kept == [costs[0][1]] if costs[0][1] != "L4" else kept == []
    for r in got.rows:
        if r.gpu.name == "L4":
            assert r.excluded and "no on-demand price" in r.excluded
        elif r.gpu.name != costs[0][1]:
            assert r.excluded and r.excluded.startswith("over budget")


def test_a_kind_nothing_fits_on_is_excluded_with_the_reason() -> None:
    kinds = [resolve_gpu("L4")]
    got = cmp.compare(
        "llama-3.1-70b",
        OPTIONS,
        {"seq_len": 8192, "checkpointing": "none"},
        kinds,
        cmp.Ask(10**9, max_gpus=8),
        FakePrices(PRICES),  # type: ignore[arg-type]
    )
    (row,) = got.rows
    assert row.pick is None and row.excluded and row.excluded.startswith("does not fit on up to 8 GPUs")


def test_resolve_kinds() -> None:
    assert [g.name for g in cmp.resolve_kinds("h100, A100-80GB,h100-sxm")] == ["H100-SXM", "A100-80GB"]
    assert len(cmp.resolve_kinds("all")) == len(cmp.gpu_catalog())
    with pytest.raises(cmp.InputError):
        cmp.resolve_kinds(" , ")


@pytest.mark.parametrize("deadline_days", [None, 20.0])
def test_offload_counts_match_brute_force(deadline_days: float | None) -> None:
    """An 8B model on 24 GB cards: the fewest counts fit only with CPU offload, so the search starts where it fits
    without it and walks down too; every count planned by brute force must agree."""
    # RTX-4090: the cheapest count (4) is in the offload regime, below the fewest without it (8) and below two nodes
    kinds = ["L4", "A10G", "RTX-4090"]
    model, prices, tokens = "llama-3.1-8b", {"L4": 0.8, "A10G": 1.0, "RTX-4090": 0.5}, 2 * 10**9
    options = {**OPTIONS, "tokens": "2B"}
    make = cmp.requests_from(model, options, SEQ)
    deadline = deadline_days * cmp.DAY if deadline_days else None
    points = {}
    for k in kinds:
        g = resolve_gpu(k)
        quote = FakePrices(prices).quote(k, "on-demand")
        net = cmp.default_interconnect(g)
        points[k] = [cmp.probe(make, g, n, g.node_gpus, net, quote) for n in cmp.gpu_counts(g.node_gpus, 32)]
    assert any(p.candidate and p.candidate.setup.levers.offload for pts in points.values() for p in pts)
    want = brute_force(points, tokens, deadline)
    got = cmp.compare(
        model, options, SEQ, [resolve_gpu(k) for k in kinds], cmp.Ask(tokens, deadline, max_gpus=32), FakePrices(prices)
    )  # type: ignore[arg-type]
    for row in got.rows:
        first = next(p for p in points[row.gpu.name] if p.candidate)
        assert row.fewest_gpus == first.gpus
        assert row.pick is not None and row.pick.gpus == want[row.gpu.name].gpus, [p.gpus for p in row.points]
    if deadline is None:
        assert want["RTX-4090"].gpus == 4 and want["RTX-4090"].candidate.setup.levers.offload
