"""The network a plan's collectives run on, from a cluster (catalog link, given bandwidths) or a bench-net report
(measured busbw per message size). Torch-free."""

from __future__ import annotations

from llmctl.errors import InputError, SpecError
from llmctl.plan import comm as cm
from llmctl.spec.hardware import Cluster

# The message size the planner reads a bench-net curve at when it has none better: FSDP's per-layer collectives
# for 7B-70B models are 100-800 MB; bench-net's bucket range (16-64 MiB) is the conservative read.
DEFAULT_BENCH_SIZE_BYTES = 64 * 2**20
# What a collective the report did not measure is read as. send_recv (ring attention's key/value pass) moves S over
# each link as all-gather's busbw counts it (both are per-link rates, bus factors 1 and (n-1)/n); reports written
# before bench-net swept send_recv lack it. Anything else unmeasured reads the all-reduce, the one always swept.
BENCH_FALLBACK = {"send_recv": "all_gather"}


def network_for(cluster: Cluster, bench_path: str | None = None) -> cm.Network:
    """The cluster's network: measured (bench-net JSON) when given, else the catalog link x efficiency inside a
    node and the cluster's inter-node bandwidth (required beyond one node)."""
    if bench_path:
        return bench_network(
            bench_path, cluster.gpus_per_node, cluster.nodes, cluster.intra_node_gbps, cluster.inter_node_gbps
        )
    intra, inter = cluster.intra_node_gbps, cluster.inter_node_gbps
    if cluster.nodes > 1 and inter is None:
        raise InputError(
            f"{cluster.nodes} nodes but no inter-node bandwidth",
            hint="pass --inter-gbps X (per node, Gbit/s) or --net bench.json",
        )
    intra_bw = cm.gbps_to_gbytes_s(intra) if intra else cluster.gpu_spec.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY
    return cm.Network(
        intra_bw, cm.gbps_to_gbytes_s(inter) if inter else None, source="given" if intra or inter else "catalog"
    )


def bench_network(
    path: str, gpus_per_node: int, nodes: int, intra_gbps: float | None, inter_gbps: float | None
) -> cm.Network:
    """A Network whose busbw comes from a bench-net report (llmctl.spec.bench.load_bench)."""
    from llmctl.spec.bench import load_bench

    rep = load_bench(path)
    # the groups the planner's scopes read: a single-node report's world group is its node, and a report with one
    # rank per node has no one-GPU-per-node groups but the world
    intra_group = "intra_node" if len(rep.nodes) > 1 else "world"
    inter_group = "inter_node" if any(r.group == "inter_node" for r in rep.results) else "world"

    def measured(group: str, collective: str) -> str:
        """`collective` if the report measured it on `group`, else what stands in for it (BENCH_FALLBACK)."""
        if rep.result(group, collective):
            return collective
        stand_in = BENCH_FALLBACK.get(collective, "all_reduce")
        return stand_in if rep.result(group, stand_in) else "all_reduce"

    if rep.ranks_per_node != gpus_per_node:
        raise SpecError(
            f"{path} measured {rep.ranks_per_node} GPUs per node but the cluster has {gpus_per_node}",
            hint="run bench-net on this cluster's nodes, or fix --gpus-per-node",
        )
    multi = len(rep.nodes) > 1
    if multi and inter_gbps is not None:
        raise InputError(
            f"--inter-gbps conflicts with the inter-node bandwidth measured in {path}",
            hint="give one of --net and --inter-gbps",
        )
    if nodes > 1 and not multi and inter_gbps is None:
        raise SpecError(
            f"{path} was measured on one node; the plan spans {nodes} nodes",
            hint="run bench-net across nodes, or add --inter-gbps X",
        )
    intra_fallback = cm.gbps_to_gbytes_s(intra_gbps) if intra_gbps else None

    def intra(collective: str, size: float) -> float:
        if intra_fallback is not None:
            return intra_fallback
        return rep.intra_node_busbw_gbytes_s(int(size), measured(intra_group, collective))

    def curve(collective: str, scope: str, size: float) -> float:
        if scope == "intra":
            return intra(collective, size)
        if not multi:
            node_bw = cm.gbps_to_gbytes_s(inter_gbps or 0.0)
            return min(intra(collective, size), node_bw if scope == "cross" else node_bw / gpus_per_node)
        if scope == "cross":
            return rep.busbw_gbytes_s("world", measured("world", collective), int(size))
        # the one-GPU-per-node groups: HYBRID's all-reduce reads the all-reduce; a ring send/recv its own sweep
        coll = measured(inter_group, collective) if collective in BENCH_FALLBACK else "all_reduce"
        bw = rep.inter_node_busbw_gbytes_s(int(size), coll)
        return float(bw) if bw else 0.0

    intra_bw = intra("all_gather", DEFAULT_BENCH_SIZE_BYTES)
    inter_node = (
        rep.inter_node_busbw_gbytes_s(DEFAULT_BENCH_SIZE_BYTES, "all_reduce", per_node=True)
        if multi
        else (cm.gbps_to_gbytes_s(inter_gbps) if inter_gbps else None)
    )
    # say so when a stand-in is read (the plan's network line and JSON carry `source`)
    stand_ins = [
        f"{c} read as {measured(intra_group, c)} (not measured)"
        for c in BENCH_FALLBACK
        if not rep.result(intra_group, c)
    ]
    note = f"; {', '.join(stand_ins)}" if stand_ins else ""
    return cm.Network(intra_bw, inter_node, curve=curve, source=f"bench-net {path}{note}")


def p2p_bandwidth(net: cm.Network, scope: str, size_bytes: float, gpus_per_node: int) -> float:
    """GB/s of one pipeline send/recv of `size_bytes` between two GPUs, inside a node ("intra") or between nodes
    ("inter"): the one place the pipeline's point-to-point rate is chosen. Today the network's send_recv reading:
    the intra-node link, or across nodes one GPU's share of its node's NICs (every GPU of a stage sends at once; a
    rail-optimised node gives each its own NIC), or a bench-net report's send_recv sweep where it has one."""
    return net.busbw("send_recv", scope, size_bytes, gpus_per_node)
