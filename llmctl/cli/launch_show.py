"""`llmctl launch --dry-start`: its options, and what it shows: rank 0's setup next to estimate-memory's figures
(the numbers are llmctl.launch.dry_start's)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from llmctl.errors import InputError, one_line

AllocateAllOpt = Annotated[
    bool,
    typer.Option(
        "--allocate-all",
        help="With --dry-start: also allocate rank 0's gradients and optimizer states (16 bytes per parameter of "
        "the shard in total) instead of only sizing them.",
    ),
]


def run_dry_start(plan: Path, dry_start: bool, dry_run: bool, allocate_all: bool, overrides: dict[str, Any]) -> None:
    """`launch PLAN --dry-start [--allocate-all] [--tp N] [--cp N] ...`: rank 0's setup here, printed; `overrides`:
    decisions given on the command line (by name), sized instead of the plan's."""
    from llmctl.launch.dry_start import dry_start as run
    from llmctl.spec.decisions import declared
    from llmctl.spec.planfile import load_plan
    from llmctl.spec.setup import TrainSetup

    flags = {d.name: d for d in declared(TrainSetup)}
    if allocate_all and not dry_start:
        raise InputError("--allocate-all only applies with --dry-start")
    for name in overrides:
        if not dry_start:
            d = flags[name]
            raise InputError(f"{d.flag} only applies with --dry-start", hint=f"set {d.key} in the plan to run it")
    if dry_run:
        raise InputError("--dry-run and --dry-start are different checks: give one")
    load_plan(plan)  # a bad plan fails here, in a fraction of a second
    at = "".join(f" at {flags[k].flag.lstrip('-')} {v}" for k, v in overrides.items())
    typer.echo(one_line(f"dry start of {plan}{at}: rank 0's setup in this machine's memory ..."), err=True)
    typer.echo(render_dry_start(run(plan, allocate_all, overrides)))


def render_dry_start(r: dict[str, Any]) -> str:
    from llmctl.units import fmt_bytes

    t = r["timings_s"]
    mesh = " x ".join(f"{n} {d}" for n, d in zip(r["mesh"], r["mesh_dims"], strict=True))
    out = [
        f"plan {r['plan']}: rank {r['rank']} of {r['world_size']} set up in {r['seconds']:.1f} s "
        f"(model on meta {t['build on meta']:.1f} s, sharding {t['parallelize']:.1f} s, "
        f"materialize {t['materialize']:.1f} s)",
        f"  mesh {mesh}; model {r['params']:,} parameters ({r['layer_params']:,} per layer); {r['init']}",
        f"  data: {r['data']}",
        "",
        f"  {'rank ' + str(r['rank']) + ' holds':<22}{'this run':>14}{'estimate-memory':>18}{'ratio':>9}",
    ]
    for line in r["lines"]:
        how = "" if line["line"] == "parameters" or line["allocated_bytes"] is not None else " (sized)"
        est, ratio = line["estimate_bytes"], line["ratio"]
        out.append(
            f"  {line['line'] + how:<22}{fmt_bytes(line['bytes']):>14}"
            f"{fmt_bytes(est) if est else '-':>18}{f'{ratio:.3f}' if ratio else '-':>9}"
        )
    out += [
        "",
        f"  peak resident memory of this process: {fmt_bytes(r['rss_peak_bytes'])} "
        f"({fmt_bytes(r['rss_before_model_bytes'])} before the model)",
    ]
    out += [f"  note: {n}" for n in r["notes"]]
    out.append("the plan starts: launch it without --dry-start")
    return "\n".join(one_line(line) for line in out)  # the plan's name and paths are the user's: escapes escaped
