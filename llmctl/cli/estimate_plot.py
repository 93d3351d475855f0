"""`llmctl estimate-memory --plot`: per-GPU memory of the setup under each strategy as stacked bars, and the GPU's
memory as a line.

`memory_plot` turns the estimates into plain data (bars, labels, the line, the title), `figure` draws that data and
nothing else, `write` saves it; the tests read the figure's artists back. The numbers are llmctl.plan.memory's: a
bar stacks the components live at that strategy's peak phase plus headroom and CUDA context (its `device_bytes`),
and the line is the GPU's memory that `fits` compares with, so a bar crosses the line exactly when the fit check
says it does not fit.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, replace
from typing import Any

from llmctl.cli import render
from llmctl.errors import InputError
from llmctl.plan import memory as mem
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import STRATEGIES
from llmctl.spec.setup import TrainSetup
from llmctl.units import GIB

# The ledger names FSDP2's master parameters "(fp32 master, sharded)" whatever the strategy; the legend is shared by
# every bar (a no_shard bar too), so it names the state only and each bar's tick label says how it is held.
_SHARDING_CLAIM = re.compile(r",\s*sharded\b")
_TICK_WIDTH = 28  # characters per tick-label line: five bars side by side on an 11-inch figure at fontsize 7


@dataclass(frozen=True)
class Bar:
    strategy: str
    label: str
    """Tick label: the strategy, then how its model states are held ("parameters, ...: sharded over 16")."""
    segments: dict[str, int]
    """Legend label -> bytes per GPU at the peak phase; sums to device_bytes."""
    device_bytes: int


@dataclass(frozen=True)
class MemoryPlot:
    title: str
    bars: list[Bar]
    chosen: str
    """The setup's own strategy (its tick label is bold)."""
    gpu_label: str | None
    """'H100-SXM: 79.6 GiB usable', None without a GPU kind."""
    gpu_bytes: int | None
    """The GPU's memory as the fit check (llmctl.plan.memory.fits) compares with it."""


def memory_plot(spec: ModelSpec, setup: TrainSetup, gpu: GPUSpec | None) -> MemoryPlot:
    """The setup under each strategy it can run with (the asked one among them), as bars; the GPU's line."""
    bars = []
    for strategy in STRATEGIES:
        alt = _with_strategy(setup, strategy)
        if alt is None:
            continue
        est = mem.estimate(spec, alt)
        segments = {_legend_name(name): b for name, b in est.per_component().items()}
        label = "\n".join([strategy, *(textwrap.fill(line, _TICK_WIDTH) for line in state_holding(est))])
        bars.append(Bar(strategy, label, segments, est.device_bytes))
    gpu_label = f"{gpu.name}: {gpu.memory_bytes / GIB:.1f} GiB usable" if gpu else None
    return MemoryPlot(_title(spec, setup, gpu), bars, setup.strategy, gpu_label, gpu.memory_bytes if gpu else None)


def state_holding(est: mem.MemoryEstimate) -> list[str]:
    """How the estimate's model states are held, states held alike on one line in ledger order:
    ["parameters, gradients, optimizer states: sharded over 16"], ["...: replicated on 16 GPUs"],
    ["...: sharded over 8 (shard group), replicated x2"]. States of zero bytes (FSDP2's half weights) are left out."""
    setup, dims = est.setup, est.setup.dims
    held = {c.name for c in est.components if c.bytes_per_param is not None and c.bytes > 0}
    groups: dict[str, list[str]] = {}
    for line in est.ledger:
        if line.name not in held:
            continue
        degree = mem.state_shard_degree(setup, line)
        if dims.dp == 1:
            how = f"one copy ({'1 GPU' if setup.world_size == 1 else 'no data parallelism'})"
        elif degree == 1:
            how = f"replicated on {dims.dp} GPUs" if dims.dp == setup.world_size else f"replicated x{dims.dp}"
        elif degree == dims.dp:
            how = f"sharded over {degree}"
        else:  # hybrid: split within a shard group, the group replicated
            how = f"sharded over {degree} (shard group), replicated x{dims.dp // degree}"
        groups.setdefault(how, []).append(line.name.split(" (")[0])
    return [f"{', '.join(names)}: {how}" for how, names in groups.items()]


def figure(plot: MemoryPlot) -> Any:
    """The matplotlib Figure of `plot` (Agg); the caller closes it."""
    plt = render.pyplot()
    fig, ax = plt.subplots(figsize=(11, 6))
    xs = list(range(len(plot.bars)))
    if plot.gpu_bytes is not None:
        ax.axhline(plot.gpu_bytes / GIB, color="crimson", linestyle="--", linewidth=1.5, label=plot.gpu_label).set_gid(
            "gpu-memory"
        )
    names = _stack_order(plot.bars)
    bottoms = [0.0] * len(plot.bars)
    cmap = plt.get_cmap("tab20")
    for j, name in enumerate(names):
        heights = [bar.segments.get(name, 0) / GIB for bar in plot.bars]
        ax.bar(xs, heights, bottom=bottoms, label=name, color=cmap(j % 20), width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, bar in zip(xs, plot.bars):
        ax.annotate(
            f"{bar.device_bytes / GIB:.1f}",
            (x, bar.device_bytes / GIB),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(xs, [bar.label for bar in plot.bars], fontsize=7)
    for tick, bar in zip(ax.get_xticklabels(), plot.bars):
        tick.set_fontweight("bold" if bar.strategy == plot.chosen else "normal")
    top = max([bar.device_bytes for bar in plot.bars] + [plot.gpu_bytes or 0]) / GIB
    ax.set_ylim(0, top * 1.08)  # room for the totals above the bars
    ax.set_ylabel("GiB per GPU (components live at each strategy's peak phase)")
    ax.set_title(plot.title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def write(spec: ModelSpec, setup: TrainSetup, gpu: GPUSpec | None, path: str) -> None:
    p = render.plot_path(path)
    render.save_figure(figure(memory_plot(spec, setup, gpu)), p)


def _with_strategy(setup: TrainSetup, strategy: str) -> TrainSetup | None:
    """The setup under another strategy, or None where that strategy cannot run it (FSDP2 has no zero1; hybrid
    needs 2 nodes or a shard size that divides the ranks). A shard size belongs to hybrid_shard alone."""
    if strategy == setup.strategy:
        return setup
    try:
        return replace(setup, strategy=strategy, shard_size=setup.shard_size if strategy == "hybrid_shard" else None)
    except InputError:
        return None


def _stack_order(bars: list[Bar]) -> list[str]:
    """Components with bytes in some bar, in one order that keeps each bar's own (states at the bottom, then FSDP's
    buffers, activations, headroom, context): the fullest bar's order, each other name placed after the one it
    follows in its own bar."""
    names: list[str] = []
    for bar in sorted(bars, key=lambda b: -len(b.segments)):
        before = -1
        for name, b in bar.segments.items():
            if name in names:
                before = names.index(name)
            elif b:
                before += 1
                names.insert(before, name)
    return names


def _legend_name(component: str) -> str:
    return _SHARDING_CLAIM.sub("", component)


def _title(spec: ModelSpec, setup: TrainSetup, gpu: GPUSpec | None) -> str:
    on = f"on {gpu.name}" if gpu else "(no GPU kind given: --gpu draws its memory)"
    par = "".join(f", {k}={v}" for k in ("tp", "pp") if (v := getattr(setup, k)) > 1)
    return (
        f"{spec.name} {on}\nstrategy {setup.strategy} (bold), {setup.nodes} node{'s' if setup.nodes > 1 else ''} x "
        f"{setup.gpus_per_node} GPU{'s' if setup.gpus_per_node > 1 else ''}{par}, micro-batch "
        f"{setup.micro_batch_size}, seq len {setup.seq_len}, checkpointing {setup.checkpointing}, "
        f"{setup.precision} {setup.optimizer}"
    )
