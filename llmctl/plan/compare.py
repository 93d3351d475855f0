"""`llmctl plan --compare`: for each GPU kind, the fewest GPUs that fit, the count that meets a deadline (or gives the
lowest cost per token), the setup, tokens/s, days and cost; rows over the deadline or the budget excluded with the
reason; the cheapest and the fastest named (torch-free).

Each point of a row is the planner's own search (llmctl.plan.planner.plan) on exactly that many GPUs of the kind, on
the kind's usual node (GPUs per node) and the inter-node network of its interconnect class (llmctl.spec.interconnect),
with the global batch `llmctl plan` would use there. Unless the user pins them, three choices are pinned to keep a
whole-catalog comparison within seconds: torch.compile on (the planner prices it faster at the same memory, so it
picks it wherever it may); CPU offload only where nothing fits without it (the planner's own rule, without its second
search for offload winning on speed); and, up to COMPARE_PIN_SEQ_LEN tokens, no context parallelism and the fastest
attention kernel the GPU runs (flash, else SDPA; eager never wins on speed): a sequence that short fits one GPU's
activations with checkpointing and TP. Past it both are searched (the ring runs on SDPA). Each row names the
`llmctl plan` command that re-runs its point with the full search (benchmarks/compare_speed.py checks that the full
search picks the same counts at 70B).

The GPU counts searched are the powers of two within a node, then whole nodes in powers of two (the counts clusters
are rented and bought in). The fewest that fit come from the memory model (memory.min_gpus, as the planner answers
when nothing fits: with CPU offload where only it fits). With a deadline: the fewest counts that finish in time, found
by stepping up from the count that compute alone would need (the planner's upper bound on tokens/s: no recompute, no
communication, the largest micro-batch), each step to the count the last one's tokens/s would need if it scaled
linearly, then back down past counts a jump skipped (never below the first guess: no count below it can meet the
deadline even at compute's bound); then larger counts while the cost still falls (more GPUs can cost
less when they free the setup from recompute, CPU offload or TP). Without a deadline, the same climb twice: from the
fewest that fit (CPU offload's counts) and from the fewest that fit without offload, the cheaper of the two lows. A
climb stops at the first count that costs more: a local search, exact where the cost per token has one low in each
regime; a last climb starts at two nodes (a pipeline stage per node keeps FSDP inside the nodes: a low of its own)
(tests/plan/test_compare.py checks it against every count, offload's counts included).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from llmctl.errors import DoesNotFitError, InputError, LlmctlError
from llmctl.plan import comm as cm
from llmctl.plan import planner as pl
from llmctl.plan.memory.fewest import fewest
from llmctl.plan.request import PlanRequest, build_request
from llmctl.plan.search import parallel_bound
from llmctl.plan.space import Choice, auto_loss_chunk
from llmctl.plan.timing import Candidate
from llmctl.spec.attention import Attention
from llmctl.spec.hardware import GPUSpec, gpu_catalog, resolve_gpu
from llmctl.spec.interconnect import Interconnect, default_interconnect, resolve_interconnect
from llmctl.spec.prices import BASES, PriceQuote, PriceTable, describe

DEFAULT_MAX_GPUS = 32768
"""The largest cluster a comparison considers (the largest published training runs used 16k-32k GPUs: Llama 3 405B
on 16,384 H100s, Dubey et al. 2024, arXiv:2407.21783)."""
COMPARE_PIN_SEQ_LEN = 16384
"""Up to this sequence length a comparison pins the fastest attention kernel (module docstring)."""
PLAN_OPTIONS = {
    "params": None,
    "net": None,
    "intra_gbps": None,
    "global_batch": None,
    "global_batch_tokens": None,
    "tokens": None,
    "overlap": cm.DEFAULT_OVERLAP,
    "calibrate": None,
    "gpus_per_node": None,
}
"""`llmctl plan`'s options that are not decisions (by name, as build_request reads them) at their defaults, for
callers outside the CLI; the decisions (pins and values, by decision name) are given apart."""
HOUR = 3600.0
DAY = 86400.0


@dataclass(frozen=True)
class Ask:
    """What the buyer asks: the tokens to train on, a deadline and a budget (None: none), the price basis, and the
    cluster shape (an interconnect class and GPUs per node for every kind; None: each kind's usual)."""

    tokens: int
    deadline_s: float | None = None
    budget_usd: float | None = None
    basis: str = "on-demand"
    interconnect: str | None = None
    gpus_per_node: int | None = None
    max_gpus: int = DEFAULT_MAX_GPUS
    today: datetime.date = field(default_factory=datetime.date.today)
    """The day the prices' ages are counted to (llmctl.spec.prices.STALE_AFTER_DAYS)."""

    def __post_init__(self) -> None:
        if self.basis not in BASES:
            raise InputError(f"unknown price basis {self.basis!r}", hint="one of: " + ", ".join(BASES))
        if self.tokens < 1:
            raise InputError(f"--tokens must be positive, got {self.tokens}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise InputError("--deadline must be a positive duration")
        if self.budget_usd is not None and not self.budget_usd > 0:
            raise InputError("--budget must be a positive number of USD")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise InputError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node}")


@dataclass(frozen=True)
class Point:
    """The planner's answer on `gpus` GPUs of one kind: its best setup, or why nothing fits there."""

    gpus: int
    nodes: int
    gpus_per_node: int
    candidate: Candidate | None
    problem: str | None = None
    fewest_gpus: int | None = None
    """Where nothing fits: the smallest count the planner found that would (DoesNotFitError.fewest_gpus)."""
    bad_input: bool = False
    """`problem` is a flag this count cannot take (an InputError), not memory."""

    def seconds(self, tokens: int) -> float | None:
        c = self.candidate
        return tokens / c.predicted.tokens_per_s if c and c.predicted.tokens_per_s > 0 else None

    def cost(self, tokens: int, price: PriceQuote | None) -> float | None:
        s = self.seconds(tokens)
        return None if s is None or price is None else self.gpus * s / HOUR * price.usd_per_gpu_hour

    def gpu_hours(self, tokens: int) -> float:
        s = self.seconds(tokens)
        return math.inf if s is None else self.gpus * s / HOUR


@dataclass
class Row:
    """One GPU kind's answer."""

    gpu: GPUSpec
    interconnect: Interconnect
    price: PriceQuote | None
    points: list[Point] = field(default_factory=list)
    """Every count probed, ascending (the plot draws them)."""
    pick: Point | None = None
    fewest_gpus: int | None = None
    """The fewest GPUs of the kind that fit, on the counts searched (with CPU offload where only it fits)."""
    fewest_without_offload: int | None = None
    excluded: str | None = None
    """Why the row is left out of the picks, in full (--json; the table's footnotes)."""
    excluded_short: str | None = None
    """The same in a few words, for the table's cell (one line)."""
    bad_input: bool = False
    """Excluded because no count of the kind can take the flags (compare raises it when every kind is so)."""
    command: str = ""

    def exclude(self, short: str, full: str) -> None:
        """Leave the row out of the picks: `short` for the table's cell, `full` for --json and the footnote."""
        self.excluded_short, self.excluded = short, full

    def as_dict(self, ask: Ask) -> dict[str, Any]:
        p, price = self.pick, self.price
        c = p.candidate if p else None
        secs = p.seconds(ask.tokens) if p else None
        return {
            "gpu": self.gpu.name,
            "gpus": p.gpus if p else None,
            "nodes": p.nodes if p else None,
            "gpus_per_node": p.gpus_per_node if p else None,
            "fewest_gpus_that_fit": self.fewest_gpus,
            "fewest_gpus_without_offload": self.fewest_without_offload,
            "interconnect": self.interconnect.name,
            "inter_node_gbps": self.interconnect.inter_node_gbps,
            "days": secs / DAY if secs is not None else None,
            "cost_usd": p.cost(ask.tokens, price) if p else None,
            "usd_per_gpu_hour": price.usd_per_gpu_hour if price else None,
            "price_basis": price.basis if price else None,
            "price_source": price.source if price else None,
            "price_date": price.date.isoformat() if price else None,
            "price_stale": price.is_stale(ask.today) if price else None,
            "tokens_per_s": c.predicted.tokens_per_s if c else None,
            "tokens_per_s_per_gpu": c.predicted.tokens_per_s_per_gpu if c else None,
            "mfu": c.predicted.mfu if c else None,
            "setup": c.label if c else None,
            "plan": c.as_dict() if c else None,
            "excluded": self.excluded,
            "excluded_short": self.excluded_short,
            "plan_only": self.gpu.plan_only,
            "command": self.command or None,
            "points": [
                {
                    "gpus": q.gpus,
                    "days": (q.seconds(ask.tokens) or 0) / DAY or None,
                    "cost_usd": q.cost(ask.tokens, price),
                }
                for q in self.points
                if q.candidate
            ],
        }


@dataclass
class Comparison:
    ask: Ask
    rows: list[Row]
    cheapest: Row | None
    fastest: Row | None
    why_cheapest: str
    why_fastest: str
    prices_note: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.ask.tokens,
            "deadline_days": self.ask.deadline_s / DAY if self.ask.deadline_s else None,
            "budget_usd": self.ask.budget_usd,
            "price_basis": self.ask.basis,
            "prices": self.prices_note,
            "comparison": [r.as_dict(self.ask) for r in self.rows],
            "cheapest": self.cheapest.gpu.name if self.cheapest else None,
            "fastest": self.fastest.gpu.name if self.fastest else None,
            "why_cheapest": self.why_cheapest,
            "why_fastest": self.why_fastest,
        }


def gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """The counts searched: powers of two below a node, the node, then whole nodes in powers of two."""
    out, n = [], 1
    while n < gpus_per_node:
        out.append(n)
        n *= 2
    nodes = 1
    while nodes * gpus_per_node <= max(max_gpus, gpus_per_node):
        out.append(nodes * gpus_per_node)
        nodes *= 2
    return out


def resolve_kinds(text: str) -> list[GPUSpec]:
    """`all` (the whole catalog) or a comma-separated list of kinds (names or aliases), each once."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise InputError("--compare needs `all` or a comma-separated list of GPU kinds")
    if [n.lower() for n in names] == ["all"]:
        return list(gpu_catalog().values())
    kinds: dict[str, GPUSpec] = {}
    for n in names:
        g = resolve_gpu(n)
        kinds.setdefault(g.name, g)
    return list(kinds.values())


Planner = Callable[[str, int, int, Interconnect, float | None], PlanRequest]
"""(kind, nodes, GPUs per node, interconnect, USD per GPU-hour) -> the request of one point."""


def requests_from(model: str, options: dict[str, Any], pins: dict[str, Any]) -> Planner:
    """The planner request of one point from `llmctl plan`'s options (build_request: every check of a single plan),
    with the point's kind, shape and network, and the comparison's pins (module docstring)."""

    specs: list[Any] = []  # the model, resolved once: the planner's caches (flops._memo, the memory search's) are
    # per spec object, so every point after the first reuses what the first computed for the same model

    def make(kind: str, nodes: int, per_node: int, net: Interconnect, price: float | None) -> PlanRequest:
        o = {
            **options,
            "gpu": kind,
            "gpus": None,
            "nodes": nodes,
            "gpus_per_node": per_node,
            "cluster": None,
            "inter_gbps": net.inter_node_gbps if nodes > 1 else None,
            "intra_gbps": options.get("intra_gbps") or net.intra_node_gbps,
            "price": price,
            "objective": "throughput",
        }
        req, _ = build_request(model, o, pins, spec=specs[0] if specs else None)
        if not specs:
            specs.append(req.spec)
        fixed = {name: req.pin(name) for name in ("attention", "cp", "compile")}
        if req.seq_len <= COMPARE_PIN_SEQ_LEN and fixed["cp"] is None:
            fixed["cp"] = 1
            if fixed["attention"] is None:
                fast = Attention.FLASH if req.precision.flash_attention and req.gpu.flash_attention else Attention.SDPA
                fixed["attention"] = req.spec.attention_kernel(fast)
        fixed["compile"] = True if fixed["compile"] is None else fixed["compile"]
        return replace(req, nodes_exact=True, explain=False).with_pins(**fixed)

    return make


def probe(make: Planner, kind: GPUSpec, gpus: int, per_node: int, net: Interconnect, price: PriceQuote | None) -> Point:
    """The planner on exactly `gpus` GPUs (one node of them below a node's worth, else whole nodes)."""
    nodes, g = shape(gpus, per_node)
    try:
        req = make(kind.name, nodes, g, net, price.usd_per_gpu_hour if price else None)
        try:  # CPU offload only where nothing fits without it (module docstring); never with adapters
            result = pl.plan(req if req.pin("offload") is not None else req.with_pins(offload=False))
        except DoesNotFitError:
            if req.pin("offload") is not None or req.finetune.adapters:
                raise
            result = pl.plan(req.with_pins(offload=True))
    except DoesNotFitError as e:
        return Point(gpus, nodes, g, None, e.message, e.fewest_gpus)
    except InputError as e:  # a pin or batch this count cannot take (e.g. --tp 8 on a 4-GPU node): not this count
        if e.message.startswith(("unknown", "cannot read")):
            raise
        return Point(gpus, nodes, g, None, str(e), bad_input=True)  # with its hint: it may be the one line
    return Point(gpus, nodes, g, result.chosen)


def fewest_bounds(req: PlanRequest) -> tuple[int | None, int | None]:
    """The fewest GPUs of the request's kind that fit (with CPU offload where it must, and without it), as the planner
    itself answers when nothing fits (llmctl.plan.memory.fewest: full_shard, full checkpointing, micro-batch 1, every tp,
    cp and pp layout); None where no
    count does."""
    fast = Attention.FLASH if req.precision.flash_attention and req.gpu.flash_attention else Attention.SDPA
    attn = req.spec.attention_kernel(fast)
    chunk = auto_loss_chunk(req.spec) if req.pin("tp") in (None, 1) else 0
    out = []
    for offload in (False, True) if not req.finetune.adapters else (False,):  # adapters: no offload (PlanRequest)
        r = req.with_pins(offload=offload)
        setup = r.candidate(checkpointing="full", attention=attn, loss_chunk_tokens=chunk)
        host = r.host_capacity_bytes if offload else None
        f = fewest(req.spec, setup, r.capacity_bytes, host_memory_bytes=host)  # every layout (tp, cp, pp)
        out.append(None if f is None else f.gpus)
    gpu_only, offloaded = (*out, None)[:2]
    either = min((n for n in out if n), default=None)
    return either, gpu_only if req.pin("offload") is not True else offloaded


def kind_row(make: Planner, kind: GPUSpec, ask: Ask, prices: PriceTable, model_cmd: str) -> Row:
    """One kind's row: the fewest GPUs that fit, then the count that meets the deadline at the least cost (or the
    lowest cost per token), and why a row is excluded."""
    per_node = ask.gpus_per_node or kind.node_gpus
    net = resolve_interconnect(ask.interconnect) if ask.interconnect else default_interconnect(kind)
    price = prices.quote(kind.name, ask.basis)
    row = Row(kind, net, price)
    counts = gpu_counts(per_node, ask.max_gpus)
    seen: dict[int, Point] = {}

    def at(i: int) -> Point:
        if counts[i] not in seen:
            seen[counts[i]] = probe(make, kind, counts[i], per_node, net, price)
        return seen[counts[i]]

    def index_at_least(n: int | None) -> int | None:
        return None if n is None else next((j for j, c in enumerate(counts) if c >= n), None)

    def first_fit(i: int | None) -> int | None:
        """The first count from index i that fits (the planner's DoesNotFitError says how far to jump)."""
        while i is not None and at(i).candidate is None:
            jump = at(i).fewest_gpus
            nxt = index_at_least(jump) if jump and jump > counts[i] else i + 1
            i = nxt if nxt is not None and nxt < len(counts) else None
        return i

    def score(p: Point) -> float:  # what the climb lowers: the cost, or GPU-hours without a price (same order)
        return p.gpu_hours(ask.tokens)

    def meets(p: Point) -> bool:
        s = p.seconds(ask.tokens)
        return s is not None and (ask.deadline_s is None or s <= ask.deadline_s)

    try:
        either, on_gpu = fewest_bounds(make(kind.name, 1, per_node, net, None))
    except InputError as e:  # a flag this kind cannot take at any count (checked again per count below)
        if e.message.startswith(("unknown", "cannot read")):
            raise
        row.exclude("flag refused", str(e))
        row.bad_input = True
        return row
    lowest = index_at_least(either) if either else 0  # no bound (e.g. only context parallelism fits): search from 1
    if lowest is None:
        row.exclude(
            "does not fit",
            f"does not fit on up to {counts[-1]:,} GPUs: the fewest that fit are {either:,}",
        )
        return row
    row.fewest_gpus = counts[lowest]
    if (k := index_at_least(on_gpu)) is not None:
        row.fewest_without_offload = counts[k]
    starts = []  # where the climbs start (the cost per token can have a low with CPU offload and one without)
    if ask.deadline_s is None:
        starts = [first_fit(lowest), first_fit(max(lowest, index_at_least(on_gpu) or lowest))]
        start = starts[0]
    else:
        # from the count that compute alone would need (an upper bound on tokens/s per GPU), up to the fewest that
        # meets the deadline
        req = make(kind.name, *shape(counts[lowest], per_node), net, None)
        fastest = Choice(
            "full_shard", req.nodes, attention=req.pin("attention") or "sdpa", compile=bool(req.pin("compile"))
        )
        bound = parallel_bound(req, fastest) / counts[lowest]
        guess = index_at_least(math.ceil(ask.tokens / (ask.deadline_s * bound)))
        j = len(counts) if guess is None else max(guess, lowest)
        while j < len(counts) and not meets(at(j)):
            # next: the count this one's tokens/s would need if it scaled linearly (it scales less: rarely past it)
            tps = at(j).candidate.predicted.tokens_per_s if at(j).candidate else 0.0
            need = counts[j] * ask.tokens / (ask.deadline_s * tps) if tps > 0 else 0.0
            nxt = index_at_least(math.ceil(need)) if need else j + 1
            j = len(counts) if nxt is None else max(nxt, j + 1)
        floor = max(lowest, guess or 0)  # below the guess even compute alone would miss the deadline
        while j < len(counts) and j - 1 >= floor and counts[j - 1] not in seen and meets(at(j - 1)):
            j -= 1  # a jump past a count that meets it too (more than linear: recompute or offload dropped)
        start = j if j < len(counts) else None
        fits = [p for p in seen.values() if p.candidate]
        if start is None and fits:
            best = max(fits, key=lambda p: p.candidate.predicted.tokens_per_s)  # type: ignore[union-attr]
            row.points, row.pick = [seen[c] for c in sorted(seen)], best
            days = best.seconds(ask.tokens) / DAY  # type: ignore[operator]
            row.exclude(
                "misses deadline",
                f"cannot meet the deadline: {days:,.1f} days on {best.gpus:,} GPUs, and its tokens/s would need more "
                f"than the {counts[-1]:,} GPUs searched even if they scaled linearly",
            )
            row.command = command(model_cmd, kind, best, net)
            return row
        if start is None and guess is None:
            row.exclude(
                "misses deadline",
                f"cannot meet the deadline: compute alone ({bound:,.0f} tokens/s per GPU at most: no recompute, no "
                f"communication) would need more than the {counts[-1]:,} GPUs searched",
            )
            return row
    row.points = [seen[c] for c in sorted(seen)]
    if start is None:
        _exclude_unplanned(row, seen, counts[-1])
        return row
    # One more climb from two nodes up: a pipeline with a stage per node keeps FSDP inside the nodes, so the cost per
    # token can fall again past a node's worth, after rising over one node's counts (issue 44)
    multi = first_fit(max(start, index_at_least(2 * per_node) or len(counts) - 1))
    if multi is not None and counts[multi] >= 2 * per_node and meets(at(multi)):
        starts.append(multi)
    lows = []
    for s0 in dict.fromkeys(x for x in [*starts, start] if x is not None):
        best_j, j = s0, s0 + 1  # larger counts while they cost less
        while j < len(counts) and at(j).candidate is not None and score(at(j)) < score(at(best_j)):
            best_j, j = j, j + 1
        lows.append(best_j)
    best_j = min(lows, key=lambda x: (score(at(x)), x))
    row.pick = at(best_j)
    row.points = [seen[c] for c in sorted(seen)]
    row.command = command(model_cmd, kind, row.pick, net)
    _check_budget(row, ask)
    return row


def _exclude_unplanned(row: Row, seen: dict[int, Point], most: int) -> None:
    """No count searched gave a setup: every count refused the flags, or none fits up to `most` GPUs."""
    last = seen[max(seen)] if seen else None
    row.bad_input = bool(seen) and all(p.bad_input for p in seen.values())
    if row.bad_input and last is not None:
        row.exclude("flag refused", f"no count takes these flags: {last.problem}")
    else:
        row.exclude("does not fit", f"does not fit on up to {most:,} GPUs" + (f": {last.problem}" if last else ""))


def _check_budget(row: Row, ask: Ask) -> None:
    """Exclude the picked row over --budget, or without a price to check it against."""
    cost = row.pick.cost(ask.tokens, row.price) if row.pick else None
    if ask.budget_usd is None:
        return
    if cost is None:
        row.exclude(
            "no price", f"no {ask.basis} price for {row.gpu.name}: the budget cannot be checked (add it with --prices)"
        )
    elif cost > ask.budget_usd:
        row.exclude("over budget", f"over budget: ${cost:,.0f} > ${ask.budget_usd:,.0f}")


def shape(gpus: int, per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of a count: one node of them below a node's worth, else whole nodes."""
    return (1, gpus) if gpus <= per_node else (gpus // per_node, per_node)


def command(model_cmd: str, kind: GPUSpec, p: Point, net: Interconnect) -> str:
    """The `llmctl plan` that re-runs a point with the full search."""
    shape = f"--gpus {p.gpus}" if p.nodes == 1 else f"--nodes {p.nodes} --gpus-per-node {p.gpus_per_node}"
    inter = f" --inter-gbps {net.inter_node_gbps:g}" if p.nodes > 1 else ""
    return f"llmctl plan {model_cmd} --gpu {kind.name} {shape}{inter}"


def compare(
    model: str,
    options: dict[str, Any],
    pins: dict[str, Any],
    kinds: list[GPUSpec],
    ask: Ask,
    prices: PriceTable,
    model_cmd: str | None = None,
) -> Comparison:
    """Every kind's row, the cheapest and the fastest picks among the rows not excluded, and why."""
    make = requests_from(model, options, pins)
    rows = []
    for kind in kinds:
        try:
            rows.append(kind_row(make, kind, ask, prices, model_cmd or model))
        except LlmctlError as e:
            net = resolve_interconnect(ask.interconnect) if ask.interconnect else default_interconnect(kind)
            quote = prices.quote(kind.name, ask.basis)
            short = "flag refused" if isinstance(e, InputError) else "cannot plan"
            rows.append(
                Row(kind, net, quote, excluded=str(e), excluded_short=short, bad_input=isinstance(e, InputError))
            )
    if rows and all(r.bad_input for r in rows):  # the flags themselves are wrong: one line, exit 2, no table
        raise InputError(rows[0].excluded or "no GPU kind can take these flags")
    ok = [r for r in rows if r.pick is not None and r.excluded is None]
    priced = [r for r in ok if r.pick.cost(ask.tokens, r.price) is not None]  # type: ignore[union-attr]
    cheapest = min(priced, key=lambda r: r.pick.cost(ask.tokens, r.price), default=None)  # type: ignore[union-attr,return-value]
    fastest = min(ok, key=lambda r: r.pick.seconds(ask.tokens), default=None)  # type: ignore[union-attr,return-value]
    quotes = {r.gpu.name: r.price for r in rows}
    return Comparison(
        ask,
        rows,
        cheapest,
        fastest,
        why_cheapest(ask, cheapest, priced),
        why_fastest(ask, fastest, ok),
        describe(quotes, ask.today),
    )


def _tokens_per_usd(ask: Ask, r: Row) -> float:
    return ask.tokens / (r.pick.cost(ask.tokens, r.price) or math.inf)  # type: ignore[union-attr]


def _stale(ask: Ask, price: PriceQuote) -> str:
    return f", a price from {price.date.year}, stale" if price.is_stale(ask.today) else ""


def _shape(r: Row) -> str:
    return f"{r.gpu.name} x {r.pick.gpus:,}"  # type: ignore[union-attr]


def why_cheapest(ask: Ask, best: Row | None, priced: list[Row]) -> str:
    """One sentence: what the cheapest costs, against the next cheapest, and where the difference comes from (its
    price per GPU-hour against its tokens/s per GPU)."""
    if best is None:
        return "no row has a price and meets the limits" if not priced else ""
    p = best.pick
    assert p is not None and p.candidate is not None and best.price is not None
    cost = p.cost(ask.tokens, best.price) or 0.0
    text = (
        f"{_shape(best)} is the cheapest: ${cost:,.0f} ({_tokens_per_usd(ask, best) / 1e6:,.2f}M tokens per USD: "
        f"{p.candidate.predicted.tokens_per_s_per_gpu:,.0f} tokens/s per GPU at ${best.price.usd_per_gpu_hour:,.2f} "
        f"per GPU-hour{_stale(ask, best.price)})"
    )
    others = sorted((r for r in priced if r is not best), key=lambda r: r.pick.cost(ask.tokens, r.price))  # type: ignore[union-attr,return-value,arg-type]
    if others:
        o = others[0]
        q = o.pick
        assert q is not None and q.candidate is not None and o.price is not None
        other = q.cost(ask.tokens, o.price) or 0.0
        text += (
            f"; next {_shape(o)} at ${other:,.0f} ({other / cost - 1:.0%} more: "
            f"{q.candidate.predicted.tokens_per_s_per_gpu:,.0f} tokens/s per GPU at ${o.price.usd_per_gpu_hour:,.2f}"
            f"{_stale(ask, o.price)})"
        )
    return text


def why_fastest(ask: Ask, best: Row | None, ok: list[Row]) -> str:
    """One sentence: how long the fastest row takes, on how many GPUs, against the next fastest."""
    if best is None:
        return "no row meets the limits"
    p = best.pick
    assert p is not None and p.candidate is not None
    days = (p.seconds(ask.tokens) or 0) / DAY
    text = (
        f"{_shape(best)} finishes first: {days:,.1f} days at {p.candidate.predicted.tokens_per_s:,.0f} tokens/s "
        f"(MFU {p.candidate.predicted.mfu:.0%}, {p.candidate.label})"
    )
    others = sorted((r for r in ok if r is not best), key=lambda r: r.pick.seconds(ask.tokens))  # type: ignore[union-attr,return-value,arg-type]
    if others:
        o = others[0]
        text += f"; next {_shape(o)} in {(o.pick.seconds(ask.tokens) or 0) / DAY:,.1f} days"  # type: ignore[union-attr]
    return text
