"""The bench-net worker: one process per rank, started by torchrun or srun. NCCL on GPUs, gloo on CPUs.

    torchrun --nnodes N --nproc-per-node K ... -m llmctl.netbench.worker -o bench.json
    srun --ntasks-per-node K python -m llmctl.netbench.worker -o bench.json   (MASTER_ADDR optional)

Phases: check-in through the TCP store (a rank that never joins is named, not waited on), a tiny all-reduce
(the data path), then the sweeps (world, intra-node, inter-node; each collective, each size) and the pairwise
inter-node test. Per size: one untimed call whose result is checked, then warm-up and timed iterations, each
a device sync, a world barrier, up to 10 back-to-back calls (fewer for big messages), a device sync; its time
is the slowest rank's. Rank 0 gathers every rank's times and writes the JSON (`llmctl.netbench.report`).

Each collective is one entry of `llmctl.netbench.calls.CALLS` (its tensors, the call, the check) and one of
`llmctl.spec.collectives` (bus factor, which size S counts); a run's options are resolved once into a `Sweep`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import torch
import torch.distributed as dist

import llmctl
from llmctl.errors import LlmctlError, RuntimeFailure
from llmctl.errors import report as report_error
from llmctl.netbench import options as opts
from llmctl.netbench.calls import BoundCall, bind
from llmctl.netbench.report import judge_nodes, round_robin_pairs
from llmctl.spec.bench import (
    BenchConfig,
    BenchReport,
    CollectiveResult,
    LinkResult,
    NodeInfo,
    SizePoint,
    aligned_size,
    bench_json,
    busbw_gbytes_s,
    dump_bench,
)
from llmctl.units import fmt_bytes

_RUN_COUNTER = itertools.count()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------- joining


@dataclass(frozen=True)
class Layout:
    """Which rank runs on which node, as every rank reported it at check-in."""

    nodes: list[NodeInfo]
    rank_node: dict[int, str]

    @property
    def uniform(self) -> bool:
        return len({len(n.ranks) for n in self.nodes}) == 1


def _make_store(env: opts.DistEnv, timeout_s: float, prefix: str) -> dist.Store:
    timeout = timedelta(seconds=timeout_s)
    if env.agent_store:  # torchrun's agent on node 0 already serves the store at MASTER_ADDR:MASTER_PORT
        store = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timeout)
    else:
        # wait_for_workers=False: rank 0 must not block in the constructor, or it could not name who is missing.
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    return dist.PrefixStore(prefix, store)


def check_in(store: dist.Store, env: opts.DistEnv, timeout_s: float) -> Layout:
    """Every rank posts (node name, node rank); rank 0 waits at most `timeout_s` and publishes the layout, or
    the list of ranks that never came, which every rank then raises."""
    store.set(f"joined/{env.rank}", json.dumps({"name": opts.node_name(), "node_rank": env.node_rank}))
    if env.rank == 0:
        deadline = time.monotonic() + timeout_s
        keys = [f"joined/{r}" for r in range(env.world_size)]
        missing = keys
        while True:
            missing = [k for k in keys if not store.check([k])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if missing:
            ranks = [int(k.split("/")[1]) for k in missing]
            where = ", ".join(f"rank {r} (node rank {r // env.local_world_size})" for r in ranks)
            store.set("verdict", json.dumps({"error": f"{where} never joined within {timeout_s:g} s"}))
        else:
            info = {r: json.loads(store.get(f"joined/{r}")) for r in range(env.world_size)}
            store.set("verdict", json.dumps({"ranks": info}))
    try:
        verdict = json.loads(store.get("verdict"))  # blocks up to the store timeout
    except Exception:
        raise RuntimeFailure(
            f"rank {env.rank}: rank 0 never published the check-in result", hint="rank 0 died or cannot be reached"
        ) from None
    if "error" in verdict:
        raise RuntimeFailure(
            f"connectivity check failed: {verdict['error']}",
            hint="check that every node started and can reach MASTER_ADDR",
        )
    by_node: dict[int, tuple[str, list[int]]] = {}
    for r_s, info in verdict["ranks"].items():
        name, ranks = by_node.setdefault(int(info["node_rank"]), (info["name"], []))
        ranks.append(int(r_s))
    nodes = [NodeInfo(name=name, node_rank=nr, ranks=sorted(ranks)) for nr, (name, ranks) in sorted(by_node.items())]
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):  # namespaces/containers sharing a hostname: keep names unique
        nodes = [n.model_copy(update={"name": f"{n.name}#{n.node_rank}"}) for n in nodes]
    return Layout(nodes=nodes, rank_node={r: n.name for n in nodes for r in n.ranks})


class Phases:
    """Marks each phase's entry and exit in the store so that a failed or timed-out collective names the ranks
    (and nodes) that never reached it or never finished it, instead of a bare gloo/NCCL timeout."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, layout: Layout) -> None:
        self.store, self.rank, self.world_size, self.layout = store, rank, world_size, layout

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.store.set(f"in/{name}/{self.rank}", "1")
        try:
            yield
        except LlmctlError:
            raise
        except Exception as e:  # a collective timed out or a peer died
            late = [r for r in range(self.world_size) if not self.store.check([f"in/{name}/{r}"])]
            stuck = [r for r in range(self.world_size) if not self.store.check([f"out/{name}/{r}"])]
            blame = late or [r for r in stuck if r != self.rank]
            who = ", ".join(f"rank {r} on {self.layout.rank_node.get(r, '?')}" for r in blame) or "unknown"
            kind = "never reached it" if late else "did not finish it"
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise RuntimeFailure(f"phase '{name}' failed on rank {self.rank}: {who} {kind} ({msg})") from e
        self.store.set(f"out/{name}/{self.rank}", "1")


# ---------------------------------------------------------------------------------------------- timing


@dataclass
class Groups:
    """The process groups of one kind: `mine` is this rank's group (None if it takes no part), `members`
    lists every concurrent group's ranks, `labels` names them."""

    kind: str
    members: list[list[int]]
    labels: list[str]
    handles: list[dist.ProcessGroup | None]
    groups_per_node: int

    def mine(self, rank: int) -> tuple[dist.ProcessGroup | None, int]:
        for ranks, h in zip(self.members, self.handles):
            if rank in ranks:
                return h, len(ranks)
        return None, 0


def _new_groups(kind: str, members: list[list[int]], labels: list[str], groups_per_node: int, backend: str) -> Groups:
    # Every rank must create every group, in the same order (torch.distributed.new_group's contract).
    handles = [
        dist.new_group(ranks, backend=backend) if len(ranks) < dist.get_world_size() else dist.group.WORLD
        for ranks in members
    ]
    return Groups(kind, members, labels, handles, groups_per_node)


@dataclass(frozen=True)
class Timer:
    device: torch.device
    iters: int
    """Timed iterations per point."""
    warmup: int
    """Untimed iterations before them."""

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, op: BoundCall | None, calls: int = 1) -> tuple[list[float], bool]:
        """Per-iteration time of one call on this rank (warm-up dropped), and whether the result was right.

        First one untimed call whose result is checked. Then each iteration: device sync, world barrier (all
        concurrent groups start together: they share the nodes' links), `calls` back-to-back calls, device
        sync; the wall time / calls. Several calls per iteration amortise the ranks leaving the barrier at
        slightly different times, as nccl-tests and all_reduce_bench do. A rank outside every group of this
        phase (`op` None) still joins the barriers and reports 0."""
        ok = True
        self.sync()
        dist.barrier()
        if op is not None:
            op.run()
            self.sync()
            ok = bool(op.check())
            op.reset()
        times = []
        for it in range(self.warmup + self.iters):
            self.sync()
            dist.barrier()
            self.sync()  # NCCL's barrier is itself device work: let it finish before the clock starts
            t0 = time.perf_counter()
            if op is not None:
                for _ in range(calls):
                    op.run()
            self.sync()
            dt = (time.perf_counter() - t0) / calls
            if it >= self.warmup:
                times.append(dt if op is not None else 0.0)
        return times, ok


def calls_per_iter(size_bytes: int, on_gpu: bool) -> int:
    """Up to 10 calls per timed iteration, fewer for big messages (all_reduce_bench: 1 from 1 GiB up on GPUs).
    CPUs (gloo over sockets) move ~100x less per second, so their budget is 64 MiB per iteration."""
    budget = 2**30 if on_gpu else 64 * 2**20
    return max(1, min(10, budget // size_bytes))


def _gather_times(times: list[float], ok: bool, world_size: int, device: torch.device) -> list[list[float]]:
    """Every rank's times (and correctness flag, last) on every rank, so that every rank raises alike.
    On the collective's device: NCCL moves only CUDA tensors."""
    t = torch.tensor([*times, 1.0 if ok else 0.0], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def time_collective(
    collective: str,
    size_bytes: int,
    *,
    iters: int,
    warmup: int = 0,
    dtype: torch.dtype = torch.float32,
    calls: int | None = None,
) -> list[float]:
    """The sweep's measurement for one point on the default (world) group, for callers that already run a
    process group (benchmarks): each timed iteration's slowest-rank time, seconds. Same code path as `run`."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    size_b = aligned_size(size_bytes, world, dtype.itemsize)
    op = bind(collective, size_b, dist.group.WORLD, dtype, device)
    calls = calls or calls_per_iter(size_b, device.type == "cuda")
    times, ok = Timer(device, iters, warmup).measure(op, calls)
    all_times = _gather_times(times, ok, world, device)
    if any(t[-1] != 1.0 for t in all_times):
        raise RuntimeFailure(f"{collective} {size_b} bytes: wrong result")
    return [max(all_times[r][i] for r in range(world)) for i in range(iters)]


# ---------------------------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Sweep:
    """What one run measures and how: the options resolved for this device (the defaults differ on GPUs and
    CPUs). Every rank resolves the same Sweep from the same options."""

    collectives: tuple[str, ...]
    """In the registry's order (`llmctl.spec.collectives`)."""
    sizes_bytes: tuple[int, ...]
    """Requested message sizes; each point rounds down to split evenly over its group (`aligned_size`)."""
    dtype_name: str
    """torch's name: float32, bfloat16 or float16."""
    iters: int
    """Timed iterations per point."""
    warmup: int
    """Untimed iterations before them."""
    pair_size_bytes: int
    """Message size of the pairwise inter-node all-reduce."""
    max_pair_rounds: int
    """Rounds of the pairwise test (each round: disjoint pairs at once)."""
    slow_fraction: float
    """A node or link below this fraction of the median is slow."""
    timeout_s: float
    """How long check-in waits for every rank, and the process group's timeout for any one collective."""
    device: torch.device
    """This rank's device: cuda:LOCAL_RANK when there is a GPU, else the CPU."""

    @classmethod
    def resolve(cls, cfg: opts.WorkerConfig, device: torch.device) -> Sweep:
        on_gpu = device.type == "cuda"
        sizes = opts.parse_sizes(cfg.sizes or (opts.DEFAULT_SIZES_GPU if on_gpu else opts.DEFAULT_SIZES_CPU))
        return cls(
            collectives=tuple(opts.parse_collectives(cfg.collectives)),
            sizes_bytes=tuple(sizes),
            dtype_name=opts.parse_dtype(cfg.dtype) if cfg.dtype else ("bfloat16" if on_gpu else "float32"),
            iters=cfg.iters or (20 if on_gpu else 10),
            warmup=cfg.warmup if cfg.warmup is not None else (5 if on_gpu else 2),
            pair_size_bytes=opts.parse_size(cfg.pair_size) if cfg.pair_size else min(max(sizes), 64 * 2**20),
            max_pair_rounds=cfg.max_pair_rounds,
            slow_fraction=cfg.slow_fraction,
            timeout_s=cfg.timeout_s,
            device=device,
        )

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype_name]

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        return "nccl" if self.on_gpu else "gloo"

    def timer(self) -> Timer:
        return Timer(self.device, self.iters, self.warmup)


class _Progress:
    def __init__(self, enabled: bool, total: int) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            force = os.environ.get("LLMCTL_FORCE_TTY") == "1" or None
            self.bar = Progress(
                TextColumn("{task.description:<40}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True, force_terminal=force),
                transient=False,
            )
            self.task = self.bar.add_task("bench-net", total=total)
            self.bar.start()

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description="done")
            self.bar.stop()


def run(cfg: opts.WorkerConfig, env: opts.DistEnv | None = None) -> BenchReport | None:
    """Run the benchmark on this rank; rank 0 writes cfg.json_path and returns the report, others None."""
    cfg.validate()
    env = env or opts.dist_env()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    sweep = Sweep.resolve(cfg, device)

    # A fresh key space per call: run() may be called several times in one job (benchmarks), and every rank
    # calls it the same number of times, so the counters agree without talking.
    prefix = f"llmctl-netbench/{next(_RUN_COUNTER)}"
    owns_pg = not dist.is_initialized()
    try:
        # The store waits longer than the check-in, so rank 0 always gets to publish who is missing.
        if owns_pg:
            store = _make_store(env, 2 * sweep.timeout_s + 10, prefix)
        else:  # embedded in a job that already has its process group: reuse its store and group
            store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    except Exception as e:  # DistStoreError / RuntimeError: rank 0 (or torchrun's agent) never came up
        raise RuntimeFailure(
            f"rank {env.rank} cannot reach the rendezvous store at {env.master_addr}:"
            f"{env.master_port} ({str(e).strip().splitlines()[0][:160] if str(e) else e!r})",
            hint="is rank 0 running, and MASTER_ADDR reachable from this node?",
        ) from None
    layout = check_in(store, env, sweep.timeout_s)
    if owns_pg:
        dist.init_process_group(
            sweep.backend,
            store=dist.PrefixStore("pg", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=sweep.timeout_s),
            device_id=device if on_gpu else None,
        )
    try:
        report = _run(sweep, env, layout, store, show_progress=cfg.progress)
        if report is not None:
            dump_bench(report, cfg.json_path)
        return report
    finally:
        if owns_pg:
            dist.destroy_process_group()


@dataclass(frozen=True)
class _Rank:
    """This rank's part in a run: what each phase of `_run` needs besides its groups."""

    sweep: Sweep
    rank: int
    world: int
    layout: Layout
    phases: Phases
    timer: Timer
    progress: _Progress


def _run(sweep: Sweep, env: opts.DistEnv, layout: Layout, store: dist.Store, show_progress: bool) -> BenchReport | None:
    rank, world = env.rank, env.world_size
    phases = Phases(store, rank, world, layout)
    with phases.phase("connectivity"):
        probe = torch.ones(1, device=sweep.device)
        dist.all_reduce(probe)
        if int(probe.item()) != world:
            raise RuntimeFailure(f"connectivity check: all-reduce of ones gave {probe.item()}, expected {world}")

    nodes = layout.nodes
    k, g = len(nodes), len(nodes[0].ranks)
    kinds: list[Groups] = []
    with phases.phase("groups"):
        if world >= 2:
            kinds.append(Groups("world", [list(range(world))], ["world"], [dist.group.WORLD], 1))
        if layout.uniform and k >= 2 and g >= 2:
            backend = sweep.backend
            kinds.append(_new_groups("intra_node", [n.ranks for n in nodes], [n.name for n in nodes], 1, backend))
            inter = [[n.ranks[i] for n in nodes] for i in range(g)]
            kinds.append(_new_groups("inter_node", inter, [f"local{i}" for i in range(g)], g, backend))
        rounds = round_robin_pairs(k)[: sweep.max_pair_rounds] if k >= 2 else []
        pair_groups = [
            [
                _new_groups("pair", [[nodes[a].ranks[0], nodes[b].ranks[0]]], [f"{a}-{b}"], 1, sweep.backend)
                for a, b in rnd
            ]
            for rnd in rounds
        ]

    total = len(kinds) * len(sweep.sizes_bytes) * len(sweep.collectives) + len(pair_groups)
    me = _Rank(sweep, rank, world, layout, phases, sweep.timer(), _Progress(show_progress and rank == 0, total))
    try:
        results = [res for grp in kinds for res in _sweep_groups(me, grp)]
        links = _pairwise(me, pair_groups, rounds)
    finally:
        me.progress.close()
    return _report(me, results, links) if rank == 0 else None


def _sweep_groups(me: _Rank, grp: Groups) -> list[CollectiveResult]:
    """Every collective at every size on one kind of group, its concurrent groups all at once."""
    sweep, rank, world, iters = me.sweep, me.rank, me.world, me.sweep.iters
    handle, n = grp.mine(rank)
    results = []
    for coll in sweep.collectives:
        points, per_group = [], {lab: [] for lab in grp.labels}
        for size in sweep.sizes_bytes:
            size_b = aligned_size(size, n or 2, sweep.dtype.itemsize)
            label = f"{grp.kind} {coll} {fmt_bytes(size_b)}"
            me.progress.step(label)
            with me.phases.phase(label):
                op = bind(coll, size_b, handle, sweep.dtype, sweep.device) if handle is not None else None
                calls = calls_per_iter(size_b, sweep.on_gpu)
                times, ok = me.timer.measure(op, calls)
                all_times = _gather_times(times, ok, world, sweep.device)
            bad = [r for r, t in enumerate(all_times) if t[-1] != 1.0]
            if bad:
                raise RuntimeFailure(
                    f"{label}: wrong result on rank(s) {bad} ({', '.join(me.layout.rank_node[r] for r in bad)})"
                )
            slowest = [max(all_times[r][i] for r in range(world)) for i in range(iters)]
            points.append(SizePoint.measured(coll, n, size_b, slowest, calls))
            for lab, members in zip(grp.labels, grp.members):
                t_med = sorted(max(all_times[r][i] for r in members) for i in range(iters))[iters // 2]
                per_group[lab].append(busbw_gbytes_s(coll, len(members), size_b, t_med))
            del op  # free this size's tensors before the next size's
            me.progress.advance()
        results.append(
            CollectiveResult(
                group=grp.kind,
                collective=coll,
                ranks_per_group=n,
                concurrent_groups=len(grp.members),
                groups_per_node=grp.groups_per_node,
                points=points,
                per_group_busbw_gbytes_s=per_group if len(grp.members) > 1 else {},
            )
        )
    return results


def _pairwise(me: _Rank, pair_groups: list[list[Groups]], rounds: list[list[tuple[int, int]]]) -> list[LinkResult]:
    """Local rank 0 of two nodes all-reduce; the disjoint pairs of one round run at the same time."""
    sweep, nodes, iters = me.sweep, me.layout.nodes, me.sweep.iters
    links = []
    size_b = aligned_size(sweep.pair_size_bytes, 2, sweep.dtype.itemsize)
    calls = calls_per_iter(size_b, sweep.on_gpu)
    for rnd, groups in zip(rounds, pair_groups):
        label = "pairs " + ", ".join(f"{nodes[a].name}-{nodes[b].name}" for a, b in rnd)
        me.progress.step(label[:40])
        mine = next((grp.handles[0] for grp in groups if me.rank in grp.members[0]), None)
        with me.phases.phase(label):
            op = bind("all_reduce", size_b, mine, sweep.dtype, sweep.device) if mine is not None else None
            times, ok = me.timer.measure(op, calls)
            all_times = _gather_times(times, ok, me.world, sweep.device)
        for (a, b), grp in zip(rnd, groups):
            ra, rb = grp.members[0]
            if all_times[ra][-1] != 1.0 or all_times[rb][-1] != 1.0:
                raise RuntimeFailure(f"pair {nodes[a].name}-{nodes[b].name}: wrong all-reduce result")
            t_med = sorted(max(all_times[ra][i], all_times[rb][i]) for i in range(iters))[iters // 2]
            links.append(
                LinkResult(
                    a=nodes[a].name,
                    b=nodes[b].name,
                    size_bytes=size_b,
                    busbw_gbytes_s=busbw_gbytes_s("all_reduce", 2, size_b, t_med),
                )
            )
        me.progress.advance()
    return links


def _report(me: _Rank, results: list[CollectiveResult], links: list[LinkResult]) -> BenchReport:
    """Rank 0's report: the results, the links judged, the slow nodes named."""
    sweep, layout, nodes = me.sweep, me.layout, me.layout.nodes
    intra = {
        lab: bws[-1]
        for r in results
        if r.group == "intra_node" and r.collective == "all_reduce"
        for lab, bws in r.per_group_busbw_gbytes_s.items()
    }
    links, verdicts = judge_nodes([n.name for n in nodes], links, intra, sweep.slow_fraction)
    device = sweep.device
    return BenchReport(
        created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        backend=sweep.backend,
        device=torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})",
        dtype=sweep.dtype_name,
        world_size=me.world,
        ranks_per_node=len(nodes[0].ranks) if layout.uniform else max(len(n.ranks) for n in nodes),
        nodes=nodes,
        versions=_versions(),
        env=opts.recorded_env(),
        config=BenchConfig(
            sizes_bytes=list(sweep.sizes_bytes),
            iters=sweep.iters,
            warmup=sweep.warmup,
            collectives=list(sweep.collectives),
            slow_fraction=sweep.slow_fraction,
        ),
        results=results,
        links=links,
        node_verdicts=verdicts,
    )


def _versions() -> dict[str, str]:
    v = {"llmctl": llmctl.__version__, "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        v["cuda"] = str(torch.version.cuda)
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return v


# ---------------------------------------------------------------------------------------------- entry point


def _parse_args(argv: list[str]) -> tuple[opts.WorkerConfig, dict[str, str | float | bool | None]]:
    p = argparse.ArgumentParser(prog="python -m llmctl.netbench.worker", description=__doc__.split("\n")[0])
    d = opts.WorkerConfig(json_path="")
    # --json-path is what the CLI passes (WorkerConfig.to_argv); -o/--json-out as in `llmctl bench-net`.
    p.add_argument("-o", "--json-out", "--json-path", dest="json_path", default="bench-net.json")
    p.add_argument("--sizes")
    p.add_argument("--dtype")
    p.add_argument("--iters", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--collectives", default=d.collectives)
    p.add_argument("--slow-fraction", type=float, default=d.slow_fraction)
    p.add_argument("--timeout-s", "--timeout", dest="timeout_s", type=float, default=d.timeout_s)
    p.add_argument("--pair-size")
    p.add_argument("--max-pair-rounds", type=int, default=d.max_pair_rounds)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    # Output on rank 0 when run directly (srun/torchrun without the llmctl CLI around it).
    p.add_argument("--json", dest="print_json", action="store_true", help="print the JSON report instead of tables")
    p.add_argument("--render", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--plot")
    p.add_argument("--expect-gbps", type=float)
    a = vars(p.parse_args(argv))
    extra = {k: a.pop(k) for k in ("print_json", "render", "plot", "expect_gbps")}
    return opts.WorkerConfig(**a), extra


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 pass, 1 runtime failure or --expect-gbps not met, 2 bad input. Errors are one line."""
    try:
        cfg, extra = _parse_args(sys.argv[1:] if argv is None else argv)
        report = run(cfg)
        if report is not None and extra["print_json"]:
            sys.stdout.write(bench_json(report))
            sys.stdout.flush()
        if report is not None and extra["render"]:
            from llmctl.netbench.render import finish, stdout_console

            finish(
                report,
                None if extra["print_json"] else stdout_console(),
                plot_path=extra["plot"],
                expect_gbps=extra["expect_gbps"],
                json_path=cfg.json_path,
            )
    except LlmctlError as e:
        return report_error(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
