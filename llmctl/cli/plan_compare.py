"""`llmctl plan MODEL --tokens T --compare all|KIND,...`: the table, JSON and plot of llmctl.plan.compare (rendering
and flag checks only; the numbers are the planner's)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from llmctl.cli import render
from llmctl.cli.compare_options import check_basis, parse_budget, parse_deadline
from llmctl.cli.decision_options import as_flags
from llmctl.errors import InputError
from llmctl.plan import compare as cmp
from llmctl.plan.memory.margin import DEFAULT_MEMORY_MARGIN
from llmctl.spec.prices import STALE_AFTER_DAYS, load_prices

COMPARE_ONLY = ("--deadline", "--budget", "--prices", "--price-basis", "--interconnect", "--plot")
"""Flags that mean something only with --compare."""


def wanted(compare: str | None, chosen: dict[str, Any], flags: dict[str, Any], file_flags: list[str]) -> bool:
    """Whether this is a comparison; one line for a flag that needs --compare (`flags`, by option name), one that
    --compare decides itself (`chosen`, by flag: None when not given), or one about the plan file a comparison does
    not write (`file_flags`, given ones)."""
    given = {f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None and v != "on-demand"}
    if compare is None:
        stray = [f for f in COMPARE_ONLY if f in given]
        if stray:
            raise InputError(f"{stray[0]} applies to a comparison", hint="add --compare all (or a list of GPU kinds)")
        return False
    clash = [f for f, v in chosen.items() if v is not None]
    if clash:
        raise InputError(
            f"--compare chooses the GPU kind, count and price itself: drop {clash[0]}",
            hint="pin GPUs per node with --gpus-per-node and the network with --interconnect",
        )
    if file_flags:
        raise InputError(
            f"{', '.join(file_flags)}: a comparison writes no plan file",
            hint="run the `llmctl plan` a row prints, with these flags, to write the plan of that row",
        )
    return True


def run(
    model: str,
    options: dict[str, Any],
    decisions: dict[str, Any],
    compare: str,
    flags: dict[str, Any],
    json_out: bool,
) -> None:
    """Check the comparison's flags, compare, show (table or JSON), plot."""
    if options.get("tokens") is None:
        raise InputError("--compare needs --tokens: time and cost are for a number of tokens", hint="e.g. --tokens 1T")
    from llmctl.spec.models import MAX_TOKENS, parse_count

    tokens = parse_count(options["tokens"], "--tokens", MAX_TOKENS)
    deadline = parse_deadline(flags["deadline"]) if flags.get("deadline") else None
    budget = parse_budget(flags["budget"]) if flags.get("budget") else None
    basis = check_basis(flags.get("price_basis") or "on-demand")
    plot = render.plot_path(flags["plot"]) if flags.get("plot") else None
    if plot is not None:
        render.pyplot()  # a missing matplotlib is one line before minutes of work, not after
    if flags.get("interconnect"):
        cmp.resolve_interconnect(flags["interconnect"])
    prices = load_prices(flags.get("prices"))
    ask = cmp.Ask(
        tokens,
        deadline,
        budget,
        basis,
        flags.get("interconnect"),
        options.get("gpus_per_node"),
    )
    kinds = cmp.resolve_kinds(compare)
    result = cmp.compare(
        model, options, decisions, kinds, ask, prices, model_cmd=" ".join([model, *plan_flags(options, decisions)])
    )
    if plot is not None:
        from llmctl.cli.compare_plot import write

        write(result, plot)
    out = result.as_dict()
    if plot is not None:
        out["plot_path"] = str(plot)
    if json_out:
        render.print_json(out)
        return
    show(result, str(plot) if plot else None)


def plan_flags(options: dict[str, Any], decisions: dict[str, Any]) -> list[str]:
    """The flags of this comparison that a row's `llmctl plan` repeats (what every row was planned with)."""
    out = []
    for key, flag in (
        ("params", "--params"),
        ("global_batch", "--global-batch"),
        ("global_batch_tokens", "--global-batch-tokens"),
        ("tokens", "--tokens"),
        ("calibrate", "--calibrate"),
        ("intra_gbps", "--intra-gbps"),
    ):
        if options.get(key) is not None:
            out += [flag, str(options[key])]
    for key, flag, default in (
        ("memory_margin", "--memory-margin", DEFAULT_MEMORY_MARGIN),
        ("overlap", "--overlap", cmp.cm.DEFAULT_OVERLAP),
    ):
        if options.get(key) not in (None, default):
            out += [flag, str(options[key])]
    return out + as_flags("plan", decisions)


def show(result: cmp.Comparison, plot: str | None) -> None:
    ask, c = result.ask, render.console
    limits = [
        f"deadline {ask.deadline_s / cmp.DAY:,.4g} days" if ask.deadline_s else "no deadline: lowest cost per token",
        f"budget ${ask.budget_usd:,.0f}" if ask.budget_usd else "no budget",
    ]
    c.print(f"[bold]{ask.tokens:,} tokens[/bold]; {'; '.join(limits)}; {ask.basis} prices")
    t = render.table(
        None,
        [
            ("GPU", "left"),
            ("GPUs", "right"),
            ("fits on", "right"),
            ("network", "left"),
            ("setup", "left"),
            ("tokens/s", "right"),
            ("MFU", "right"),
            ("days", "right"),
            ("$/GPU-h", "right"),
            ("cost", "right"),
            ("", "left"),
        ],
    )
    excluded: list[cmp.Row] = []
    for r in sorted(result.rows, key=lambda r: _order(r, ask)):
        d = r.as_dict(ask)
        mark = "cheapest" if r is result.cheapest else ""
        if r is result.fastest:
            mark = f"{mark}, fastest" if mark else "fastest"
        note = mark
        if r.excluded:
            excluded.append(r)
            note = f"[{len(excluded)}] {r.excluded_short or 'excluded'}"
        if d["plan_only"] and not r.excluded:
            note = (note + "; " if note else "") + "plan-only"
        shape = (
            "-"
            if d["gpus"] is None
            else f"{d['gpus']:,}" + (f" ({d['nodes']}x{d['gpus_per_node']})" if d["nodes"] > 1 else "")
        )
        t.add_row(
            r.gpu.name,
            shape,
            _fits(d["fewest_gpus_that_fit"], d["fewest_gpus_without_offload"]),
            r.interconnect.name,
            escape(_setup(r)),
            "-" if d["tokens_per_s"] is None else f"{d['tokens_per_s']:,.0f}",
            "-" if d["mfu"] is None else f"{d['mfu']:.0%}",
            "-" if d["days"] is None else f"{d['days']:,.1f}",
            _price(r, ask),
            "-" if d["cost_usd"] is None else f"${d['cost_usd']:,.0f}",
            escape(note),
        )
    c.print(t)
    c.print(escape(legend(result)), soft_wrap=True)
    for i, r in enumerate(excluded, 1):
        c.print(f"[{i}] {escape(r.gpu.name)}: {escape(r.excluded or '')}", soft_wrap=True, markup=False)
    if result.cheapest:
        c.print(f"cheapest: {escape(result.why_cheapest)}", soft_wrap=True)
    else:
        c.print(f"cheapest: {escape(result.why_cheapest) or 'none'}", soft_wrap=True)
    c.print(f"fastest: {escape(result.why_fastest)}", soft_wrap=True)
    picks = [result.cheapest] + ([result.fastest] if result.fastest is not result.cheapest else [])
    for r in picks:
        if r is not None and r.command:
            c.print(f"full search of {r.gpu.name}'s row: {escape(r.command)}", soft_wrap=True)
    c.print(escape(result.prices_note), soft_wrap=True)
    c.print(
        "each row: the planner on exactly that many GPUs (compile on; up to "
        f"{cmp.COMPARE_PIN_SEQ_LEN:,} tokens the fastest attention kernel), counts in powers of two",
        soft_wrap=True,
    )
    if plot:
        c.print(f"plot: {plot}")


def legend(result: cmp.Comparison) -> str:
    """What the table's abbreviations mean (the ones it shows)."""
    parts = [
        "fits on: the fewest GPUs that fit without CPU offload, '(N offl)' where N fit with it ('N offl': only with "
        "it)",
        "setup: ppN/tpN/cpN/epN pipeline/tensor/context/expert-parallel degrees (hybrid: HYBRID_SHARD, no: "
        "NO_SHARD, else FULL_SHARD), mbMxA micro-batch M x A accumulation steps, no-/sel-/full-ckpt activation "
        "checkpointing",
    ]
    if any(r.price is not None and r.price.is_stale(result.ask.today) for r in result.rows):
        parts.append(f"$/GPU-h (YYYY): a price from that year, stale (over {STALE_AFTER_DAYS // 365} years old)")
    if any(r.excluded for r in result.rows):
        parts.append("[n] reason: excluded from the picks, the full reason below the legend")
    return "legend: " + "; ".join(parts)


def _price(r: cmp.Row, ask: cmp.Ask) -> str:
    """The price per GPU-hour, with its year where it is stale."""
    if r.price is None:
        return "-"
    stale = f" ({r.price.date.year})" if r.price.is_stale(ask.today) else ""
    return f"{r.price.usd_per_gpu_hour:,.2f}{stale}"


def _order(r: cmp.Row, ask: cmp.Ask) -> tuple:
    """Rows kept first, by cost (rows without a price after), then the excluded ones."""
    cost = r.pick.cost(ask.tokens, r.price) if r.pick else None
    days = r.pick.seconds(ask.tokens) if r.pick else None
    return (r.excluded is not None, cost is None, cost or 0.0, days or float("inf"), r.gpu.name)


def _fits(fewest: int | None, on_gpu: int | None) -> str:
    """'16', or '16 (1 offl)' where CPU offload fits fewer GPUs; '-' where none fits."""
    if fewest is None:
        return "-"
    if on_gpu is None:
        return f"{fewest:,} offl"
    return f"{on_gpu:,}" + (f" ({fewest:,} offl)" if fewest < on_gpu else "")


def _setup(r: cmp.Row) -> str:
    c = r.pick.candidate if r.pick else None
    if c is None:
        return "-"
    s = c.setup
    parts = [] if s.strategy == "full_shard" else [s.strategy.replace("_shard", "")]
    parts += s.dims.tags()
    parts.append(f"mb{s.micro_batch_size}" + (f"x{s.grad_accum_steps}" if s.grad_accum_steps > 1 else ""))
    parts.append(
        {"none": "no-ckpt", "selective": "sel-ckpt", "full": "full-ckpt"}.get(s.checkpointing, s.checkpointing)
    )
    if s.levers.offload:
        parts.append("offload")
    return " ".join(parts)
