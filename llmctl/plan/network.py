"""The network a plan's collectives run on, from a cluster (catalog link, given bandwidths) or a bench-net report
(measured busbw per message size). Torch-free."""

from __future__ import annotations

from llmctl.errors import InputError, SpecError
from llmctl.plan import comm as cm
from llmctl.spec.collectives import ring_steps
from llmctl.spec.hardware import Cluster

# The message size the planner reads a bench-net curve at when it has none better: FSDP's per-layer collectives
# for 7B-70B models are 100-800 MB; bench-net's bucket range (16-64 MiB) is the conservative read.
DEFAULT_BENCH_SIZE_BYTES = 64 * 2**20
# What a collective the report did not measure is read as. send_recv (ring attention's key/value pass) moves S over
# each link as all-gather's busbw counts it (both are per-link rates, bus factors 1 and (n-1)/n); reports written
# before bench-net swept send_recv lack it. all_to_all (expert parallelism's dispatch and combine) moves the same
# (n-1)/n of S in and out of each rank as an all-gather, in n-1 direct messages instead of a ring's n-1 hops: its
# busbw read as the all-gather's is optimistic where many small messages or incast slow the all-to-all down. Anything
# else unmeasured reads the all-reduce, the one always swept.
BENCH_FALLBACK = {"send_recv": "all_gather", "all_to_all": "all_gather"}
# The stand-ins the plan's network line names. A plan without experts reads no all-to-all, so a line about its
# stand-in would be noise there; it joins when the planner prices expert parallelism with `alltoall_time`.
NOTED_STAND_INS = ("send_recv",)


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
        for c in NOTED_STAND_INS
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


def alltoall_time(
    net: cm.Network, bytes_per_rank: float, ep: int, gpus_per_node: int, ep_in_node: int | None = None
) -> float:
    """Seconds of one all-to-all over an expert-parallel group of `ep` ranks (one MoE layer's token dispatch, or its
    combine), each rank sending `bytes_per_rank`: nccl-tests alltoall_perf's S, its ep chunks of S/ep, its own
    included (a dispatch: the tokens it routes x hidden x dtype bytes, every top-k copy counted). `ep_in_node`: the
    group's ranks on each node; default min(ep, gpus_per_node), the ep ranks consecutive (torchtitan's mesh, tp 1).

    Where the bytes go: of its ep chunks a rank keeps one, sends ep_in_node - 1 to the ranks of its own node over the
    intra-node link (NVLink) and ep - ep_in_node to ranks of other nodes through the NICs, so
        t = alpha x (ep - 1) + max(S (ep_in_node - 1)/ep / intra busbw, S (ep - ep_in_node)/ep / inter busbw).
    - The two links are separate and NCCL's all-to-all drives them together (one group of sends and receives), hence
      the max; PXN's relay of the inter-node chunks over NVLink to the NIC's GPU is not counted.
    - Every GPU of a node belongs to some ep group and an MoE layer runs all of them at once, so the inter busbw is
      one GPU's share of its node's NICs (the "inter" scope): the node's inter-node bandwidth / gpus_per_node
      without a measurement, and with a bench-net report its all-to-all sweep over the inter-node groups (every local
      rank exchanging at once: busbw = the off-node bytes (k-1)/k S per rank / t, exactly that share).
    - Inside a node (ep_in_node == ep) the NIC term vanishes and this is `collective_time_s("all_to_all", ...)` at the
      intra-node busbw: (ep-1)/ep of S, nccl-tests' bus factor.
    - alpha: n-1 messages (pairwise exchange), at the inter-node alpha once the group spans nodes.
    Links without a measurement (the network's `busbw`, as for every collective): the catalog link x
    DEFAULT_LINK_EFFICIENCY inside a node (or --intra-gbps), the node's NICs (--inter-gbps) / gpus_per_node between
    nodes; a bench-net report without the all-to-all sweep reads its all-gather's (BENCH_FALLBACK). Both curves are
    read at S. Load imbalance (a rank receiving more than S) is the caller's: pass the busiest rank's bytes."""
    if ep <= 1 or bytes_per_rank <= 0:
        return 0.0
    in_node = min(ep, gpus_per_node) if ep_in_node is None else ep_in_node
    if not 1 <= in_node <= min(ep, gpus_per_node) or ep % in_node:
        raise InputError(
            f"an ep group of {ep} cannot put {in_node} ranks on each node of {gpus_per_node} GPUs",
            hint="ep_in_node divides ep and is at most gpus_per_node",
        )
    steps = ring_steps("all_to_all", ep)
    intra_bw = net.busbw("all_to_all", "intra", bytes_per_rank, gpus_per_node)
    nvlink_s = bytes_per_rank * (in_node - 1) / ep / (intra_bw * 1e9)
    if in_node == ep:
        return net.alpha("intra") * steps + nvlink_s
    nic_bw = net.busbw("all_to_all", "inter", bytes_per_rank, gpus_per_node)
    nic_s = bytes_per_rank * (ep - in_node) / ep / (nic_bw * 1e9)
    return net.alpha("inter") * steps + max(nvlink_s, nic_s)
