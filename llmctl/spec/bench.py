"""The bench-net report: nccl-tests bandwidth math and the versioned JSON schema that `llmctl bench-net` writes and
`llmctl plan --net FILE` reads (the contract between them, as planfile.py is between plan and launch).

Torch-free: the planner reads the JSON through `load_bench`, and the CLI renders it, without importing torch. The
worker (`llmctl.netbench.worker`) builds a `BenchReport` from measured times; slow-node rules are
llmctl.netbench.report.

Units: sizes in bytes, times in seconds, bandwidths in GB/s (1e9 bytes/s, as nccl-tests prints them).
`gbit_s()` converts to Gbit/s, the unit NICs are sold in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmctl.errors import SpecError
from llmctl.fileio import load_json, write_atomic
from llmctl.spec.collectives import COLLECTIVES, bus_factor

# The collectives and nccl-tests' busbw/algbw factors: one registry, shared with the planner's cost model.

SCHEMA_NAME = "llmctl.bench-net"
SCHEMA_VERSION = 1

Collective = Literal[COLLECTIVES]  # type: ignore[valid-type]  # the registry's names, in its order
GroupKind = Literal["world", "intra_node", "inter_node"]
GROUP_KINDS: tuple[str, ...] = ("world", "intra_node", "inter_node")

# FSDP's default bucket sizes fall in this range; the planner's per-collective message sizes do too.
BUCKET_RANGE_BYTES = (16 * 2**20, 64 * 2**20)
PEAK_FRACTION = 0.8


# ---------------------------------------------------------------------------------------------- bandwidth math


def algbw_gbytes_s(size_bytes: int, time_s: float) -> float:
    """algbw = bytes / time (nccl-tests). `size_bytes` is the all-reduce buffer, the all-gather *output*
    and the reduce-scatter *input*, as nccl-tests counts them."""
    if time_s <= 0:
        raise ValueError(f"time must be positive, got {time_s}")
    return size_bytes / time_s / 1e9


def busbw_gbytes_s(collective: str, n_ranks: int, size_bytes: int, time_s: float) -> float:
    """busbw = algbw x bus_factor (nccl-tests)."""
    return algbw_gbytes_s(size_bytes, time_s) * bus_factor(collective, n_ranks)


def gbit_s(gbytes_s: float) -> float:
    """GB/s -> Gbit/s."""
    return gbytes_s * 8


def aligned_size(size_bytes: int, n_ranks: int, elem_bytes: int) -> int:
    """The largest size <= size_bytes that splits into n equal chunks of whole elements (all-gather and
    reduce-scatter need that); never below one element per rank."""
    quantum = n_ranks * elem_bytes
    return max(quantum, size_bytes // quantum * quantum)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------------- schema


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TimeStats(_Model):
    """Per-iteration times of one size; each iteration's time is the slowest rank's."""

    median: float = Field(gt=0)
    min: float = Field(gt=0)
    max: float = Field(gt=0)
    p10: float = Field(gt=0)
    p90: float = Field(gt=0)

    @classmethod
    def of(cls, times_s: Sequence[float]) -> TimeStats:
        return cls(
            median=statistics.median(times_s),
            min=min(times_s),
            max=max(times_s),
            p10=percentile(times_s, 10),
            p90=percentile(times_s, 90),
        )


class SizePoint(_Model):
    """One message size: time statistics and the bandwidths derived from them (never a mean of bandwidths)."""

    size_bytes: int = Field(gt=0)
    iters: int = Field(gt=0)
    time_s: TimeStats
    algbw_gbytes_s: float = Field(ge=0)
    """From the median time."""
    busbw_gbytes_s: float = Field(ge=0)
    """From the median time."""
    busbw_gbytes_s_min: float = Field(ge=0)
    """From the slowest iteration."""
    busbw_gbytes_s_max: float = Field(ge=0)
    """From the fastest iteration."""
    calls_per_iter: int = Field(default=1, ge=1)
    """Back-to-back calls timed together in each iteration; times are per call."""

    @classmethod
    def measured(
        cls, collective: str, n_ranks: int, size_bytes: int, times_s: Sequence[float], calls_per_iter: int = 1
    ) -> SizePoint:
        stats = TimeStats.of(times_s)
        return cls(
            size_bytes=size_bytes,
            iters=len(times_s),
            calls_per_iter=calls_per_iter,
            time_s=stats,
            algbw_gbytes_s=algbw_gbytes_s(size_bytes, stats.median),
            busbw_gbytes_s=busbw_gbytes_s(collective, n_ranks, size_bytes, stats.median),
            busbw_gbytes_s_min=busbw_gbytes_s(collective, n_ranks, size_bytes, stats.max),
            busbw_gbytes_s_max=busbw_gbytes_s(collective, n_ranks, size_bytes, stats.min),
        )


class Summary(_Model):
    peak_busbw_gbytes_s: float
    peak_size_bytes: int
    bucket_busbw_gbytes_s: float | None
    """Median busbw over the measured sizes in 16-64 MiB (FSDP bucket sizes); None if none was measured."""
    size_for_80pct_peak_bytes: int
    """The smallest measured size whose busbw reaches 80% of the peak."""


def summarize(points: Sequence[SizePoint]) -> Summary:
    """Peak busbw, busbw at FSDP bucket sizes, and the smallest size that reaches 80% of the peak."""
    if not points:
        raise ValueError("no points to summarize")
    peak = max(points, key=lambda p: p.busbw_gbytes_s)
    lo, hi = BUCKET_RANGE_BYTES
    bucket = [p.busbw_gbytes_s for p in points if lo <= p.size_bytes <= hi]
    reach = min(
        (p.size_bytes for p in points if p.busbw_gbytes_s >= PEAK_FRACTION * peak.busbw_gbytes_s),
        default=peak.size_bytes,
    )
    return Summary(
        peak_busbw_gbytes_s=peak.busbw_gbytes_s,
        peak_size_bytes=peak.size_bytes,
        bucket_busbw_gbytes_s=statistics.median(bucket) if bucket else None,
        size_for_80pct_peak_bytes=reach,
    )


class CollectiveResult(_Model):
    """One collective on one kind of group, swept over sizes. For `inter_node`, `groups_per_node` groups run at
    the same time through each node (one per local rank), which is what HYBRID's inter-node all-reduce meets."""

    group: GroupKind
    collective: Collective
    ranks_per_group: int = Field(ge=2)
    concurrent_groups: int = Field(ge=1)
    groups_per_node: int = Field(ge=1)
    points: list[SizePoint] = Field(min_length=1)
    per_group_busbw_gbytes_s: dict[str, list[float]] = Field(default_factory=dict)
    """busbw per concurrent group (keyed by node name for intra_node), one value per size, from that group's
    own slowest-rank median time: the per-node timing that slow-node detection uses."""

    @field_validator("points")
    @classmethod
    def _sorted(cls, points: list[SizePoint]) -> list[SizePoint]:
        return sorted(points, key=lambda p: p.size_bytes)

    @property
    def summary(self) -> Summary:
        return summarize(self.points)

    def busbw_at(self, size_bytes: int) -> float:
        """busbw at any size: linear in log(size) between measured sizes, clamped outside the measured range."""
        pts = self.points
        if size_bytes <= pts[0].size_bytes:
            return pts[0].busbw_gbytes_s
        if size_bytes >= pts[-1].size_bytes:
            return pts[-1].busbw_gbytes_s
        for a, b in zip(pts, pts[1:]):
            if a.size_bytes <= size_bytes <= b.size_bytes:
                t = math.log(size_bytes / a.size_bytes) / math.log(b.size_bytes / a.size_bytes)
                return a.busbw_gbytes_s + t * (b.busbw_gbytes_s - a.busbw_gbytes_s)
        raise AssertionError("unreachable")  # pragma: no cover


class NodeInfo(_Model):
    name: str = Field(min_length=1)
    node_rank: int = Field(ge=0)
    ranks: list[int] = Field(min_length=1)


class LinkResult(_Model):
    """One pairwise inter-node all-reduce (local rank 0 of each node)."""

    a: str
    b: str
    size_bytes: int = Field(gt=0)
    busbw_gbytes_s: float = Field(ge=0)
    slow: bool = False


class NodeVerdict(_Model):
    name: str
    best_link_busbw_gbytes_s: float | None = None
    intra_busbw_gbytes_s: float | None = None
    slow: bool = False
    reason: str | None = None


class BenchConfig(_Model):
    sizes_bytes: list[int] = Field(min_length=1)
    iters: int = Field(gt=0)
    warmup: int = Field(ge=0)
    collectives: list[Collective] = Field(min_length=1)
    slow_fraction: float = Field(gt=0, lt=1)


class BenchReport(_Model):
    """What `llmctl bench-net --json FILE` writes and `llmctl plan --net FILE` reads."""

    schema_name: Literal["llmctl.bench-net"] = Field(default=SCHEMA_NAME, alias="schema")
    schema_version: Literal[1] = SCHEMA_VERSION
    created_utc: str
    backend: str
    device: str
    dtype: str
    world_size: int = Field(ge=1)
    ranks_per_node: int = Field(ge=1)
    nodes: list[NodeInfo] = Field(min_length=1)
    versions: dict[str, str]
    env: dict[str, str]
    config: BenchConfig
    results: list[CollectiveResult]
    links: list[LinkResult] = Field(default_factory=list)
    node_verdicts: list[NodeVerdict] = Field(default_factory=list)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _consistent(self) -> BenchReport:
        if sum(len(n.ranks) for n in self.nodes) != self.world_size:
            raise ValueError(
                f"nodes list {sum(len(n.ranks) for n in self.nodes)} ranks, world_size says {self.world_size}"
            )
        return self

    # ---- what the planner asks
    @property
    def hosts(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def slow_nodes(self) -> list[str]:
        return [v.name for v in self.node_verdicts if v.slow]

    @property
    def slow_links(self) -> list[tuple[str, str]]:
        return [(lk.a, lk.b) for lk in self.links if lk.slow]

    def result(self, group: str, collective: str = "all_reduce") -> CollectiveResult | None:
        for r in self.results:
            if r.group == group and r.collective == collective:
                return r
        return None

    def busbw_gbytes_s(self, group: str, collective: str = "all_reduce", size_bytes: int = 32 * 2**20) -> float:
        """busbw of `collective` on `group` at `size_bytes` (interpolated), GB/s. SpecError if not measured."""
        r = self.result(group, collective)
        if r is None:
            measured = ", ".join(f"{x.group}/{x.collective}" for x in self.results) or "nothing"
            raise SpecError(f"bench-net report has no {group}/{collective} result (it has {measured})")
        return r.busbw_at(size_bytes)

    def intra_node_busbw_gbytes_s(self, size_bytes: int = 32 * 2**20, collective: str = "all_reduce") -> float:
        """Inside one node. A single-node run has only the world group, which is then the intra-node figure."""
        group = "intra_node" if self.result("intra_node", collective) else "world"
        if len(self.nodes) > 1 and group == "world":
            raise SpecError("bench-net report has several nodes but no intra-node result (1 rank per node?)")
        return self.busbw_gbytes_s(group, collective, size_bytes)

    def inter_node_busbw_gbytes_s(
        self, size_bytes: int = 32 * 2**20, collective: str = "all_reduce", per_node: bool = False
    ) -> float | None:
        """Across nodes, per group of one rank per node, while the node's other local ranks run their own
        groups concurrently (HYBRID's inter-node all-reduce). `per_node=True` multiplies by those concurrent
        groups: the node's aggregate, comparable to its NICs' rate. None for a single-node run."""
        if len(self.nodes) < 2:
            return None
        group = "inter_node" if self.result("inter_node", collective) else "world"
        r = self.result(group, collective)
        bw = self.busbw_gbytes_s(group, collective, size_bytes)
        return bw * r.groups_per_node if per_node and r is not None else bw


def link_result(bench: BenchReport, collective: str, inter_node: bool) -> CollectiveResult | None:
    """`collective`'s sweep over the links inside a node (the intra-node groups; a single-node report's world) or
    between nodes (the inter-node groups, every local rank's at once; a world group that crosses nodes when there
    are no such groups, its slowest hop an inter-node one). None where the report has no such sweep."""
    several = len(bench.nodes) > 1
    world = bench.result("world", collective)
    if inter_node:
        return (bench.result("inter_node", collective) or world) if several else None
    # several nodes without intra-node groups (one rank per node, uneven nodes): nothing measured inside a node
    return bench.result("intra_node", collective) or (None if several else world)


def p2p_result(bench: BenchReport, inter_node: bool) -> CollectiveResult | None:
    """The send/recv sweep over the links a pipeline's stage-to-stage sends cross (`link_result`): between nodes the
    inter-node groups', as every rank of a stage sends to the next stage's together."""
    return link_result(bench, "send_recv", inter_node)


def p2p_bandwidth(bench: BenchReport, inter_node: bool, size_bytes: int = 32 * 2**20) -> float | None:
    """GB/s of nccl-tests' sendrecv between ranks of one node or of two nodes (`p2p_result`) at `size_bytes` (the
    message: a pipeline stage's activations; interpolated in log size, clamped to the measured range): each rank sends
    S to the next while it receives S from the previous, algbw = S / t and busbw = algbw (NVIDIA/nccl-tests
    doc/PERFORMANCE.md). None without a send/recv sweep over those links (reports written before bench-net swept it,
    `--collectives` without send_recv, or a link the run did not cross): the caller then says what it assumed."""
    r = p2p_result(bench, inter_node)
    return None if r is None else r.busbw_at(size_bytes)


def alltoall_result(bench: BenchReport, inter_node: bool) -> CollectiveResult | None:
    """The all-to-all sweep over the links an expert-parallel group's dispatch and combine cross (`link_result`):
    inside a node, or between nodes the inter-node groups', all local ranks exchanging at once as every GPU of a node
    does in an MoE layer (so its busbw is one GPU's share of the node's NICs)."""
    return link_result(bench, "all_to_all", inter_node)


def alltoall_bandwidth(bench: BenchReport, inter_node: bool, size_bytes: int = 32 * 2**20) -> float | None:
    """busbw GB/s of nccl-tests' alltoall (`alltoall_result`) at `size_bytes`, the total each rank sends (its n
    chunks, its own included; interpolated in log size, clamped to the measured range): algbw = S / t, busbw = algbw
    x (n-1)/n, the rate each rank's links carry the (n-1)/n of S that leaves it (NVIDIA/nccl-tests
    doc/PERFORMANCE.md). None without an all-to-all sweep over those links (reports written before bench-net swept
    it, `--collectives` without all_to_all, or a link the run did not cross): the caller says what it assumed."""
    r = alltoall_result(bench, inter_node)
    return None if r is None else r.busbw_at(size_bytes)


def load_bench(path: str | Path) -> BenchReport:
    """Read and validate a bench-net JSON file; any problem is one SpecError line naming the file."""
    p = Path(path)
    data = load_json(p, "bench-net report")
    if not isinstance(data, dict):
        raise SpecError(f"{p} is not a bench-net report (expected a JSON object)")
    if data.get("schema") != SCHEMA_NAME:
        raise SpecError(
            f"{p} is not a bench-net report (schema is {data.get('schema')!r}, expected {SCHEMA_NAME!r})",
            hint="write one with `llmctl bench-net -o FILE`",
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise SpecError(
            f"{p} has bench-net schema_version {data.get('schema_version')!r}; this llmctl reads "
            f"version {SCHEMA_VERSION}"
        )
    try:
        return BenchReport.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        more = f" (+{e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise SpecError(f"{p}: invalid bench-net report at {where}: {err['msg']}{more}") from None


def bench_json(report: BenchReport) -> str:
    """The versioned JSON text: what `dump_bench` writes and `llmctl bench-net --json` prints."""
    return report.model_dump_json(indent=2, by_alias=True) + "\n"


def dump_bench(report: BenchReport, path: str | Path) -> None:
    """Write the JSON atomically (a reader never sees half a file)."""
    write_atomic(path, bench_json(report))
