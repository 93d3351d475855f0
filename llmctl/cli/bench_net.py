"""`llmctl bench-net`: measure all-reduce / all-gather / reduce-scatter / ring send-recv bandwidth inside and across
nodes.

Outside a launcher it starts torchrun (`--standalone` on one node; `--nnodes/--node-rank/--master-addr` for
several, one command per node). Inside torchrun or an srun step it runs the worker in this process:

    srun --nodes 4 --ntasks-per-node 8 llmctl bench-net -o bench.json

Torch is imported only in that second case (`llmctl --help` stays torch-free).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from llmctl.cli.options import JsonOpt
from llmctl.errors import InputError
from llmctl.netbench import options as opts

if TYPE_CHECKING:
    pass


NprocOpt = Annotated[int, typer.Option("--nproc-per-node", help="Ranks per node (GPUs per node; CPU processes).")]
SizesOpt = Annotated[
    Optional[str],
    typer.Option(
        "--sizes",
        help="Message sizes: A..B (x2 steps), A..B:F, or a list 1M,16M. "
        f"Default {opts.DEFAULT_SIZES_GPU} on GPUs, {opts.DEFAULT_SIZES_CPU} on CPUs.",
        show_default=False,
    ),
]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option("--dtype", help="bf16 | fp16 | fp32. Default bf16 on GPUs, fp32 on CPUs.", show_default=False),
]
ItersOpt = Annotated[
    Optional[int], typer.Option("--iters", help="Timed iterations per size (20 GPU, 10 CPU).", show_default=False)
]
WarmupOpt = Annotated[
    Optional[int], typer.Option("--warmup", help="Warm-up iterations per size (5 GPU, 2 CPU).", show_default=False)
]
CollectivesOpt = Annotated[str, typer.Option("--collectives", help=f"Comma list of {', '.join(opts.COLLECTIVES)}.")]
JsonFileOpt = Annotated[
    Optional[Path],
    typer.Option(
        "-o",
        "--json-out",
        help="Write the versioned JSON report to this file (what `llmctl plan --net` reads).",
        show_default=False,
    ),
]
PlotOpt = Annotated[
    Optional[Path], typer.Option("--plot", help="Write a PNG of busbw against message size.", show_default=False)
]
ExpectOpt = Annotated[
    Optional[float],
    typer.Option(
        "--expect-gbps",
        help="Pass/fail: the inter-node all-reduce peak busbw per node (single node: all-reduce "
        "busbw) must reach this many Gbit/s and no node may be slow; exit 1 otherwise.",
        show_default=False,
    ),
]
SlowOpt = Annotated[
    float, typer.Option("--slow-fraction", help="Flag a node or link below this fraction of the median.")
]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for every rank to join, and for any one collective.")
]
NnodesOpt = Annotated[int, typer.Option("--nnodes", help="Nodes (run this command once on each).")]
NodeRankOpt = Annotated[int, typer.Option("--node-rank", help="This node's rank (0 writes the report).")]
MasterAddrOpt = Annotated[str, typer.Option("--master-addr", help="Address of node rank 0, reachable by all.")]
MasterPortOpt = Annotated[int, typer.Option("--master-port", help="TCP port on node rank 0.")]
PairSizeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--pair-size",
        help="Message size of the pairwise inter-node test (default: the largest size, <= 64 MiB).",
        show_default=False,
    ),
]
PairRoundsOpt = Annotated[
    int,
    typer.Option(
        "--max-pair-rounds",
        help="Rounds of the pairwise test (each round: disjoint pairs at once); fewer than nodes-1 samples the pairs.",
    ),
]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")]


def register(app: typer.Typer) -> None:
    app.command("bench-net", help="Measure collective bandwidth inside and across nodes; find a slow node.")(bench_net)


def bench_net(
    nproc_per_node: NprocOpt = 2,
    sizes: SizesOpt = None,
    dtype: DtypeOpt = None,
    iters: ItersOpt = None,
    warmup: WarmupOpt = None,
    collectives: CollectivesOpt = ",".join(opts.COLLECTIVES),
    print_json: JsonOpt = False,
    json_path: JsonFileOpt = None,
    plot: PlotOpt = None,
    expect_gbps: ExpectOpt = None,
    slow_fraction: SlowOpt = 0.7,
    timeout: TimeoutOpt = 300.0,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    master_addr: MasterAddrOpt = "127.0.0.1",
    master_port: MasterPortOpt = 29511,
    pair_size: PairSizeOpt = None,
    max_pair_rounds: PairRoundsOpt = 8,
    progress: ProgressOpt = True,
) -> None:
    """Sweep message sizes for each collective on the world, inside each node and across nodes."""
    if nproc_per_node < 1:
        raise InputError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise InputError(f"--node-rank must be in [0, --nnodes), got {node_rank} with --nnodes {nnodes}")
    if nnodes * nproc_per_node < 2:
        raise InputError("bench-net needs at least 2 ranks", hint="--nproc-per-node 2 on one node")
    if expect_gbps is not None and expect_gbps <= 0:
        raise InputError(f"--expect-gbps must be positive, got {expect_gbps}")
    for path in (json_path, plot):
        if path is not None and not path.parent.is_dir():
            raise InputError(f"folder {path.parent} does not exist (for {path})")

    with tempfile.TemporaryDirectory(prefix="llmctl-bench-net-") as tmp:
        cfg = opts.WorkerConfig(
            json_path=str(json_path or Path(tmp) / "bench-net.json"),
            sizes=sizes,
            dtype=dtype,
            iters=iters,
            warmup=warmup,
            collectives=collectives,
            slow_fraction=slow_fraction,
            timeout_s=timeout,
            pair_size=pair_size,
            max_pair_rounds=max_pair_rounds,
            progress=progress,
        )
        cfg.validate()
        if opts.inside_launcher():
            from llmctl.netbench import worker  # torch, only now

            report = worker.run(cfg)
            if report is None:  # not rank 0: rank 0 prints and writes
                return
        else:
            from llmctl.launch.bench_net import run_worker
            from llmctl.launch.local import Rendezvous

            rdzv = Rendezvous(nnodes, node_rank, master_addr, master_port, timeout_s=cfg.timeout_s)
            run_worker(cfg, nproc_per_node, rdzv, Path(tmp))
            if node_rank != 0:
                # with --json, stdout carries the report only, and only node rank 0 has one
                typer.echo(f"node rank {node_rank} done; node rank 0 wrote the report", err=print_json)
                return
            from llmctl.spec.bench import load_bench

            report = load_bench(cfg.json_path)
        from llmctl.netbench.render import finish, stdout_console

        if print_json:  # before the pass/fail check: a failed expectation still prints what was measured
            from llmctl.spec.bench import bench_json

            sys.stdout.write(bench_json(report))
            sys.stdout.flush()
        finish(
            report,
            None if print_json else stdout_console(),
            plot_path=str(plot) if plot else None,
            expect_gbps=expect_gbps,
            json_path=str(json_path) if json_path else None,
        )
