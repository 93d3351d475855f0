"""`llmctl plan --compare ... --plot FILE.png`: cost against days, one line per GPU kind through the GPU counts the
comparison planned (each point labelled with its count), the row's pick circled, the deadline and budget as lines,
and the Pareto front (no other point is both cheaper and faster) drawn through the points that make it.

`compare_plot` turns the comparison into plain data, `figure` draws that data and nothing else, `write` saves it; the
tests read the data and the saved file back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.cli import render
from llmctl.errors import InputError
from llmctl.plan import compare as cmp


@dataclass(frozen=True)
class Series:
    gpu: str
    points: list[tuple[float, float, int]]
    """(days, cost USD, GPUs) of every count planned that has a price, ascending in GPUs."""
    pick: tuple[float, float, int] | None
    excluded: bool


@dataclass(frozen=True)
class ComparePlot:
    title: str
    series: list[Series]
    pareto: list[tuple[float, float]]
    """(days, cost) of the points no other point beats on both, ascending in days."""
    deadline_days: float | None
    budget_usd: float | None


def compare_plot(result: cmp.Comparison) -> ComparePlot:
    ask, series = result.ask, []
    for r in result.rows:
        pts = []
        for p in r.points:
            cost, secs = p.cost(ask.tokens, r.price), p.seconds(ask.tokens)
            if cost is not None and secs is not None:
                pts.append((secs / cmp.DAY, cost, p.gpus))
        if not pts:
            continue
        pick = None
        if r.pick is not None and (c := r.pick.cost(ask.tokens, r.price)) is not None:
            pick = ((r.pick.seconds(ask.tokens) or 0) / cmp.DAY, c, r.pick.gpus)
        series.append(Series(r.gpu.name, pts, pick, r.excluded is not None))
    every = sorted((d, c) for s in series for d, c, _ in s.points)
    pareto, best = [], float("inf")
    for d, c in every:
        if c < best:
            pareto.append((d, c))
            best = c
    title = f"{ask.tokens:,} tokens: cost vs time per GPU kind ({ask.basis} prices)"
    return ComparePlot(title, series, pareto, ask.deadline_s / cmp.DAY if ask.deadline_s else None, ask.budget_usd)


def figure(plot: ComparePlot) -> Any:
    """The matplotlib Figure of `plot` (Agg); the caller closes it."""
    plt = render.pyplot()
    fig, ax = plt.subplots(figsize=(13, 7.5))
    colors = plt.get_cmap("tab20").colors
    for i, s in enumerate(plot.series):
        xs, ys = [p[0] for p in s.points], [p[1] for p in s.points]
        style = {"alpha": 0.35} if s.excluded else {}
        marker = "osD^v<>"[i // len(colors) % 7]
        (line,) = ax.plot(
            xs, ys, marker=marker, markersize=3, linewidth=1, label=s.gpu, color=colors[i % len(colors)], **style
        )
        for d, c, n in s.points:
            ax.annotate(str(n), (d, c), fontsize=6, xytext=(2, 2), textcoords="offset points", color=line.get_color())
        if s.pick is not None:
            ax.scatter([s.pick[0]], [s.pick[1]], s=90, facecolors="none", edgecolors=line.get_color(), linewidths=1.5)
    if plot.pareto:
        ax.plot(*zip(*plot.pareto), color="black", linestyle=":", linewidth=1, label="Pareto front")
    if plot.deadline_days:
        ax.axvline(plot.deadline_days, color="red", linestyle="--", linewidth=1, label="deadline")
    if plot.budget_usd:
        ax.axhline(plot.budget_usd, color="darkred", linestyle="-.", linewidth=1, label="budget")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("days")
    ax.set_ylabel("cost, USD")
    ax.set_title(plot.title, fontsize=10)
    ax.grid(True, which="both", linewidth=0.3, alpha=0.5)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def write(result: cmp.Comparison, path: Path) -> None:
    plot = compare_plot(result)
    if not plot.series:
        raise InputError(f"--plot {path}: no row has both a price and a setup that fits: nothing to draw")
    render.save_figure(figure(plot), path)
