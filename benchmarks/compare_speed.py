"""`llmctl plan --compare all` for a 70B model over the whole GPU catalog: how long it takes, against what a user
would do without it (a `llmctl plan` per GPU kind and count, the full search, every count), side by side.

1. The comparison's CPU time in-process (llmctl.plan.compare.compare), with a deadline and without, at the default
   largest cluster (32,768 GPUs), and end to end (`llmctl plan ... --compare all --json` in a fresh interpreter:
   the child's CPU time, imports included).
2. The alternative on the same grid: for every kind, `planner.plan` with the full search (no pins) at every count
   the comparison could choose (powers of two up to --max-gpus), then the cheapest count per kind that meets the
   deadline, by the same cost formula. Its CPU time, the ratio, and whether the two agree: each kind's pick costs
   within 1% of the brute force's (the counts are printed side by side; the comparison's pins: compile on, the
   fastest kernel, offload only where nothing fits without it).

Exits non-zero if the picks disagree beyond that. The issue's target is under 2 s of CPU for the whole catalog;
the script prints the figure and says whether it is met (it does not fail on it: the figure is reported as is).

Run: .venv/bin/python benchmarks/compare_speed.py [--model llama-3.1-70b] [--tokens 1T] [--deadline-days 60]
     [--max-gpus 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmctl.errors import LlmctlError  # noqa: E402
from llmctl.plan import compare as cmp  # noqa: E402
from llmctl.plan import planner as pl  # noqa: E402
from llmctl.spec.models import MAX_TOKENS, parse_count  # noqa: E402
from llmctl.spec.prices import load_prices  # noqa: E402

OPTIONS = cmp.PLAN_OPTIONS


def timed_compare(model: str, tokens: int, deadline_s: float | None, max_gpus: int) -> tuple[float, cmp.Comparison]:
    kinds = list(cmp.gpu_catalog().values())
    prices = load_prices()
    t = time.process_time()
    result = cmp.compare(
        model, {**OPTIONS, "tokens": str(tokens)}, {}, kinds, cmp.Ask(tokens, deadline_s, max_gpus=max_gpus), prices
    )
    return time.process_time() - t, result


def cli_cpu(model: str, tokens: int, deadline_days: float) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmctl",
            "plan",
            model,
            "--tokens",
            str(tokens),
            "--compare",
            "all",
            "--deadline",
            f"{deadline_days:g}d",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        print(r.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"the CLI failed with exit {r.returncode}")
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def brute_force(
    model: str, tokens: int, deadline_s: float, max_gpus: int
) -> tuple[float, dict[str, tuple[int, float]]]:
    """Per kind: (GPUs, cost) of the cheapest count meeting the deadline, full search at every count."""
    make = cmp.requests_from(model, {**OPTIONS, "tokens": str(tokens)}, {})
    prices = load_prices()
    out: dict[str, tuple[int, float]] = {}
    t = time.process_time()
    for kind in cmp.gpu_catalog().values():
        price = prices.quote(kind.name, "on-demand")
        net = cmp.default_interconnect(kind)
        best: tuple[int, float] | None = None
        for n in cmp.gpu_counts(kind.node_gpus, max_gpus):
            nodes, g = (1, n) if n <= kind.node_gpus else (n // kind.node_gpus, kind.node_gpus)
            try:
                req = make(kind.name, nodes, g, net, price.usd_per_gpu_hour if price else None)
                # the full search: no pins of the comparison's (compile, kernel, cp)
                req = dataclasses.replace(req, compile=None, attention=None, cp=None)
                c = pl.plan(req).chosen
            except LlmctlError:
                continue
            secs = tokens / c.predicted.tokens_per_s
            if secs > deadline_s:
                continue
            cost = n * secs / 3600 * (price.usd_per_gpu_hour if price else 1.0)
            if best is None or cost < best[1]:
                best = (n, cost)
        if best is not None:
            out[kind.name] = best
    return time.process_time() - t, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tokens", default="1T")
    ap.add_argument("--deadline-days", type=float, default=60.0)
    ap.add_argument("--max-gpus", type=int, default=1024, help="largest count of the side-by-side (brute force) run")
    args = ap.parse_args()
    tokens = parse_count(args.tokens, "--tokens", MAX_TOKENS)
    deadline = args.deadline_days * 86400
    kinds = len(cmp.gpu_catalog())
    print(f"{args.model}, {tokens:,} tokens, {kinds} GPU kinds, on-demand prices ({datetime.date.today()})")
    for label, dl in ((f"deadline {args.deadline_days:g} days", deadline), ("no deadline", None)):
        cpu, res = timed_compare(args.model, tokens, dl, cmp.DEFAULT_MAX_GPUS)
        probes = sum(len(r.points) for r in res.rows)
        print(
            f"compare all, {label}, up to {cmp.DEFAULT_MAX_GPUS:,} GPUs: {cpu:.2f} s CPU, {probes} counts planned "
            f"({probes / kinds:.1f} per kind); cheapest {res.cheapest.gpu.name if res.cheapest else None}"
        )
    e2e = cli_cpu(args.model, tokens, args.deadline_days)
    print(
        f"end to end (`llmctl plan {args.model} --tokens {args.tokens} --compare all --deadline "
        f"{args.deadline_days:g}d --json`): {e2e:.2f} s CPU; target < 2 s: {'met' if e2e < 2 else 'NOT met'}"
    )

    cpu_cmp, res = timed_compare(args.model, tokens, deadline, args.max_gpus)
    cpu_bf, want = brute_force(args.model, tokens, deadline, args.max_gpus)
    print(f"\nside by side, counts up to {args.max_gpus:,} GPUs, deadline {args.deadline_days:g} days:")
    print(f"  llmctl plan --compare: {cpu_cmp:8.2f} s CPU")
    print(f"  a full `plan` per kind and count: {cpu_bf:8.2f} s CPU   ratio {cpu_bf / cpu_cmp:.1f}x")
    bad = []
    print(f"  {'GPU':14s} {'compare':>18s} {'brute force':>18s}")
    for r in res.rows:
        got = (
            (r.pick.gpus, r.pick.cost(tokens, r.price) or r.pick.gpu_hours(tokens))
            if r.pick and not r.excluded
            else None
        )
        ref = want.get(r.gpu.name)
        unit = "$" if r.price else "GPU-h "  # a kind without a price: both sides in GPU-hours
        fmt = lambda x, unit=unit: "-" if x is None else f"{x[0]:>5,} {unit}{x[1]:>11,.0f}"  # noqa: E731
        ok = (got is None and ref is None) or (got is not None and ref is not None and got[1] <= ref[1] * 1.01)
        print(f"  {r.gpu.name:14s} {fmt(got):>18s} {fmt(ref):>18s} {'' if ok else '  <- differs'}")
        if not ok:
            bad.append(r.gpu.name)
    print("OK: every kind's pick costs within 1% of the brute force's" if not bad else f"DIFFERS: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
