"""Rendering of a BenchReport: rich tables, the summary, slow nodes, the PNG plot, the --expect-gbps verdict.

Torch-free; matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llmctl.errors import InputError, RuntimeFailure
from llmctl.spec.bench import BenchReport, CollectiveResult, alltoall_result, gbit_s, p2p_result
from llmctl.units import MIB, fmt_bytes


def result_table(r: CollectiveResult) -> Table:
    title = f"{r.group} {r.collective}: {r.concurrent_groups} group(s) x {r.ranks_per_group} ranks" + (
        f", {r.groups_per_node} concurrent per node" if r.groups_per_node > 1 else ""
    )
    t = Table(title=title, title_justify="left")
    for col in ("size", "time median (ms)", "time p10-p90 (ms)", "algbw GB/s", "busbw GB/s", "busbw min-max"):
        t.add_column(col, justify="right")
    for p in r.points:
        t.add_row(
            fmt_bytes(p.size_bytes),
            f"{p.time_s.median * 1e3:.3f}",
            f"{p.time_s.p10 * 1e3:.3f}-{p.time_s.p90 * 1e3:.3f}",
            f"{p.algbw_gbytes_s:.3f}",
            f"{p.busbw_gbytes_s:.3f}",
            f"{p.busbw_gbytes_s_min:.3f}-{p.busbw_gbytes_s_max:.3f}",
        )
    return t


def summary_table(report: BenchReport) -> Table:
    t = Table(title="summary (busbw, nccl-tests definition)", title_justify="left")
    cols = (
        "group",
        "collective",
        "peak GB/s",
        "peak Gbit/s",
        "per node Gbit/s",
        "at size",
        "16-64 MiB GB/s",
        "80% of peak from",
    )
    for col in cols:
        t.add_column(col, justify="right" if col not in ("group", "collective") else "left")
    for r in report.results:
        s = r.summary
        # inter_node: each node carries groups_per_node such groups at once; their sum is the node's rate
        per_node = f"{gbit_s(s.peak_busbw_gbytes_s) * r.groups_per_node:.2f}" if r.group == "inter_node" else ""
        t.add_row(
            r.group,
            r.collective,
            f"{s.peak_busbw_gbytes_s:.3f}",
            f"{gbit_s(s.peak_busbw_gbytes_s):.2f}",
            per_node,
            fmt_bytes(s.peak_size_bytes),
            "-" if s.bucket_busbw_gbytes_s is None else f"{s.bucket_busbw_gbytes_s:.3f}",
            fmt_bytes(s.size_for_80pct_peak_bytes),
        )
    return t


def _peaks_line(report: BenchReport, result: Callable[[BenchReport, bool], CollectiveResult | None]) -> str | None:
    """Each sweep `result` picks (inside a node, between nodes) at its peak; None when the run swept neither."""
    parts = []
    for inter_node, where in ((False, "inside a node"), (True, "between nodes")):
        r = result(report, inter_node)
        if r is not None:
            s = r.summary
            parts.append(f"{where} {s.peak_busbw_gbytes_s:.3f} GB/s at {fmt_bytes(s.peak_size_bytes)}")
    return "; ".join(parts) if parts else None


def p2p_line(report: BenchReport) -> str | None:
    """The send/recv sweeps a pipeline's stage-to-stage sends are priced with (llmctl.spec.bench.p2p_bandwidth), at
    their peak; None when the run swept no send/recv."""
    peaks = _peaks_line(report, p2p_result)
    return None if peaks is None else "P2P send/recv between pipeline stages (busbw = algbw, peak): " + peaks


def alltoall_line(report: BenchReport) -> str | None:
    """The all-to-all sweeps an expert-parallel group's dispatch and combine are priced with
    (llmctl.spec.bench.alltoall_bandwidth), at their peak; None when the run swept no all-to-all."""
    peaks = _peaks_line(report, alltoall_result)
    return None if peaks is None else "all-to-all for expert parallelism (busbw, peak): " + peaks


def render(report: BenchReport, console: Console | None = None) -> None:
    console = console or Console()
    hosts = ", ".join(f"{n.name} ({len(n.ranks)} rank{'s' if len(n.ranks) > 1 else ''})" for n in report.nodes)
    console.print(
        escape(
            f"bench-net: {report.world_size} ranks on {len(report.nodes)} node(s): {hosts}; "
            f"backend {report.backend}, {report.dtype}, {report.device}"
        )
    )
    for r in report.results:
        console.print(result_table(r))
    if report.results:
        console.print(summary_table(report))
    for line in (p2p_line(report), alltoall_line(report)):
        if line:
            console.print(escape(line))
    if report.links:
        t = Table(title="inter-node links (pairwise all-reduce, local rank 0 of each node)", title_justify="left")
        for col in ("link", "size", "busbw GB/s", "Gbit/s", "verdict"):
            t.add_column(col, justify="left" if col in ("link", "verdict") else "right")
        for lk in report.links:
            t.add_row(
                f"{lk.a} - {lk.b}",
                fmt_bytes(lk.size_bytes),
                f"{lk.busbw_gbytes_s:.3f}",
                f"{gbit_s(lk.busbw_gbytes_s):.2f}",
                "SLOW" if lk.slow else "ok",
            )
        console.print(t)
    for v in report.node_verdicts:
        if v.slow:
            console.print(f"[bold red]slow node: {escape(v.name)}[/]: {escape(v.reason or '')}")
    if len(report.nodes) == 2:
        console.print("slow-node check: needs 3 nodes or more (with 2 there is no majority); see the link above")
    elif len(report.nodes) > 2 and not report.slow_nodes:
        console.print(f"no slow node (threshold {report.config.slow_fraction:g} x median)")


def expected_figure_gbit_s(report: BenchReport) -> tuple[str, float]:
    """What --expect-gbps is compared against: the inter-node all-reduce peak busbw per node (all its concurrent
    groups together, comparable to its NICs' rate), or on a single node the world all-reduce peak busbw."""
    r = report.result("inter_node") or report.result("world")
    if r is None:
        raise RuntimeFailure("no all-reduce result to compare with --expect-gbps (was all_reduce skipped?)")
    per = r.groups_per_node if r.group == "inter_node" else 1
    what = "inter-node all-reduce busbw per node" if len(report.nodes) > 1 else "all-reduce busbw"
    return what, gbit_s(r.summary.peak_busbw_gbytes_s) * per


def check_expectation(report: BenchReport, expect_gbps: float) -> tuple[bool, str]:
    what, got = expected_figure_gbit_s(report)
    slow = report.slow_nodes
    ok = got >= expect_gbps and not slow
    msg = f"{what} peak {got:.2f} Gbit/s vs expected {expect_gbps:g} Gbit/s"
    if slow:
        msg += f"; slow node(s): {', '.join(slow)}"
    return ok, ("PASS: " if ok else "FAIL: ") + msg


def plot(report: BenchReport, path: str | Path) -> None:
    """busbw against message size, one line per group and collective (log-2 x axis)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise InputError("--plot needs matplotlib", hint="pip install 'llmctl[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for r in report.results:
        xs = [p.size_bytes / MIB for p in r.points]
        ax.plot(xs, [p.busbw_gbytes_s for p in r.points], marker="o", label=f"{r.group} {r.collective}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("busbw (GB/s)")
    hosts = ", ".join(report.hosts)
    ax.set_title(f"bench-net: {report.world_size} ranks, {report.backend}, {report.dtype} [{hosts}]"[:90])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise InputError(f"cannot write plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def stdout_console() -> Console:
    """Where the tables go. They are 7 columns wide: give them room when stdout is a file or a pipe (rich then
    assumes 80)."""
    return Console() if sys.stdout.isatty() else Console(width=120)


def finish(
    report: BenchReport,
    console: Console | None,
    *,
    plot_path: str | None = None,
    expect_gbps: float | None = None,
    json_path: str | None = None,
) -> None:
    """Tables, optional plot, optional pass/fail (RuntimeFailure, exit 1, when the expectation is not met).
    `console` None prints nothing (`--json`: stdout carries the JSON report only); a failure still raises."""
    if console is not None:
        render(report, console)
        if json_path:
            console.print(f"wrote {json_path}")
    if plot_path:
        plot(report, plot_path)
        if console is not None:
            console.print(f"wrote {plot_path}")
    if expect_gbps is not None:
        ok, msg = check_expectation(report, expect_gbps)
        if not ok:
            raise RuntimeFailure(msg)
        if console is not None:
            console.print(f"[green]{msg}[/]")
