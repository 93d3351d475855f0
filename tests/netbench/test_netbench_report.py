"""bench-net's torch-free half: nccl-tests math (hand-checked numbers), schema, loader, options, CLI input errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import InputError, SpecError
from llmctl.netbench import options as opts
from llmctl.netbench import report as rp
from llmctl.spec import bench, collectives

MiB = 2**20


# ---------------------------------------------------------------------------------------------- math


def test_busbw_golden_numbers() -> None:
    # all-reduce, 4 ranks, 64 MiB in 0.5 s: algbw = 67108864 / 0.5 = 134.217728 MB/s; busbw x 2*3/4 = 1.5
    assert bench.algbw_gbytes_s(64 * MiB, 0.5) == pytest.approx(0.134217728)
    assert bench.busbw_gbytes_s("all_reduce", 4, 64 * MiB, 0.5) == pytest.approx(0.201326592)
    # all-gather, 8 ranks, 1 GiB output in 2 s: algbw 0.536870912, busbw x 7/8 = 0.469762048
    assert bench.busbw_gbytes_s("all_gather", 8, 2**30, 2.0) == pytest.approx(0.469762048)
    # reduce-scatter, 2 ranks, 1e9 bytes input in 1 s: algbw 1.0, busbw x 1/2
    assert bench.busbw_gbytes_s("reduce_scatter", 2, 10**9, 1.0) == pytest.approx(0.5)
    # all-reduce on 2 ranks: factor 1, busbw == algbw
    assert collectives.bus_factor("all_reduce", 2) == 1.0
    # send/recv (nccl-tests sendrecv_perf), 8 ranks, each sends 64 MiB to the next in 0.5 s: algbw = busbw =
    # 67108864 / 0.5 / 1e9, whatever the ring's size
    assert bench.busbw_gbytes_s("send_recv", 8, 64 * MiB, 0.5) == pytest.approx(0.134217728)
    assert collectives.bus_factor("send_recv", 2) == collectives.bus_factor("send_recv", 1024) == 1.0
    # all-to-all (nccl-tests alltoall_perf), 8 ranks, each sends 1 GiB in all (8 chunks of 128 MiB, its own kept) in
    # 2 s: algbw 0.536870912, busbw x 7/8 = 0.469762048; on 2 ranks half of S moves: x 1/2
    assert bench.busbw_gbytes_s("all_to_all", 8, 2**30, 2.0) == pytest.approx(0.469762048)
    assert collectives.bus_factor("all_to_all", 2) == 0.5
    assert collectives.ring_steps("all_to_all", 8) == 7  # one message to each peer
    assert bench.gbit_s(0.125) == 1.0


def test_bus_factor_rejects_nonsense() -> None:
    with pytest.raises(InputError):
        collectives.bus_factor("broadcast", 4)
    with pytest.raises(ValueError):
        bench.algbw_gbytes_s(1, 0.0)


@given(st.sampled_from(collectives.COLLECTIVES), st.integers(2, 4096))
def test_bus_factor_bounds(collective: str, n: int) -> None:
    f = collectives.bus_factor(collective, n)
    if collective == "send_recv":
        assert f == 1.0  # every link carries S, whatever n
    else:
        assert 0 < f < (2 if collective == "all_reduce" else 1)


def test_aligned_size_and_percentile() -> None:
    assert bench.aligned_size(MiB, 3, 4) == 1048572  # 3 ranks x 4-byte floats: 87381 elements each
    assert bench.aligned_size(MiB, 4, 4) == MiB
    assert bench.aligned_size(1, 4, 4) == 16
    assert bench.percentile([1, 2, 3, 4, 5], 10) == pytest.approx(1.4)
    assert bench.percentile([3.0], 90) == 3.0


def test_size_point_uses_median_time_not_mean_of_bandwidths() -> None:
    p = bench.SizePoint.measured("all_reduce", 2, 10**9, [1.0, 2.0, 4.0])
    assert p.time_s.median == 2.0
    assert p.busbw_gbytes_s == pytest.approx(0.5)  # from the median time; the mean of bandwidths would be 0.583
    assert p.busbw_gbytes_s_min == pytest.approx(0.25)
    assert p.busbw_gbytes_s_max == pytest.approx(1.0)


def _points(busbw_by_mib: dict[int, float]) -> list[bench.SizePoint]:
    # time chosen so that busbw (2 ranks, all-reduce: factor 1) equals the given value
    return [
        bench.SizePoint.measured("all_reduce", 2, m * MiB, [m * MiB / (bw * 1e9)] * 3) for m, bw in busbw_by_mib.items()
    ]


def test_summary() -> None:
    s = bench.summarize(_points({1: 1.0, 4: 5.0, 16: 8.5, 32: 9.0, 64: 10.0, 128: 9.5}))
    assert s.peak_busbw_gbytes_s == pytest.approx(10.0)
    assert s.peak_size_bytes == 64 * MiB
    assert s.bucket_busbw_gbytes_s == pytest.approx(9.0)  # median of 16, 32, 64 MiB: 8.5, 9, 10
    assert s.size_for_80pct_peak_bytes == 16 * MiB  # first size >= 0.8 x 10


def test_round_robin_pairs_cover_every_pair_once() -> None:
    for k in range(2, 9):
        rounds = rp.round_robin_pairs(k)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == [(a, b) for a in range(k) for b in range(a + 1, k)]
        for r in rounds:  # disjoint inside a round
            nodes = [n for p in r for n in p]
            assert len(nodes) == len(set(nodes))


def test_judge_nodes_names_the_node_behind_the_slow_links() -> None:
    links = [
        bench.LinkResult(a="n0", b="n1", size_bytes=MiB, busbw_gbytes_s=0.12),
        bench.LinkResult(a="n0", b="n2", size_bytes=MiB, busbw_gbytes_s=0.03),
        bench.LinkResult(a="n1", b="n2", size_bytes=MiB, busbw_gbytes_s=0.031),
    ]
    judged, verdicts = rp.judge_nodes(["n0", "n1", "n2"], links, {}, 0.7)
    assert [v.name for v in verdicts if v.slow] == ["n2"]
    assert [(lk.a, lk.b) for lk in judged if lk.slow] == [("n0", "n2"), ("n1", "n2")]
    assert "n2" not in (verdicts[0].reason or "") and "best inter-node link" in verdicts[2].reason
    # intra-node slowness is caught too
    _, verdicts = rp.judge_nodes(["a", "b", "c"], [], {"a": 5.0, "b": 5.1, "c": 1.0}, 0.7)
    assert [v.name for v in verdicts if v.slow] == ["c"]


# ---------------------------------------------------------------------------------------------- schema


def make_report(nodes: int = 2, g: int = 2) -> bench.BenchReport:
    pts_fast = _points({4: 2.0, 16: 4.0, 64: 4.0})
    pts_slow = _points({4: 0.05, 16: 0.06, 64: 0.06})
    results = [
        bench.CollectiveResult(
            group="world",
            collective="all_reduce",
            ranks_per_group=nodes * g,
            concurrent_groups=1,
            groups_per_node=1,
            points=pts_slow,
        )
    ]
    if nodes > 1:
        results += [
            bench.CollectiveResult(
                group="intra_node",
                collective="all_reduce",
                ranks_per_group=g,
                concurrent_groups=nodes,
                groups_per_node=1,
                points=pts_fast,
            ),
            bench.CollectiveResult(
                group="inter_node",
                collective="all_reduce",
                ranks_per_group=nodes,
                concurrent_groups=g,
                groups_per_node=g,
                points=pts_slow,
            ),
        ]
    return bench.BenchReport(
        created_utc="2026-11-22T05:00:00+00:00",
        backend="gloo",
        device="cpu",
        dtype="float32",
        world_size=nodes * g,
        ranks_per_node=g,
        nodes=[
            bench.NodeInfo(name=f"node{i}", node_rank=i, ranks=list(range(i * g, (i + 1) * g))) for i in range(nodes)
        ],
        versions={"torch": "2.13.0"},
        env={"GLOO_SOCKET_IFNAME": "fab0"},
        config=bench.BenchConfig(
            sizes_bytes=[4 * MiB, 16 * MiB, 64 * MiB], iters=3, warmup=1, collectives=["all_reduce"], slow_fraction=0.7
        ),
        results=results,
    )


def test_schema_round_trip(tmp_path: Path) -> None:
    r = make_report()
    path = tmp_path / "bench.json"
    bench.dump_bench(r, path)
    data = json.loads(path.read_text())
    assert data["schema"] == "llmctl.bench-net" and data["schema_version"] == 1
    assert bench.load_bench(path) == r


def with_collective(r: bench.BenchReport, collective: str, busbw: float) -> bench.BenchReport:
    """`r` plus a `collective` result on each group its all-reduce was measured on, `busbw` GB/s at every size."""

    def point(n: int, size: int) -> bench.SizePoint:
        return bench.SizePoint.measured(
            collective, n, size, [size * collectives.bus_factor(collective, n) / (busbw * 1e9)]
        )

    more = [
        res.model_copy(
            update={"collective": collective, "points": [point(res.ranks_per_group, p.size_bytes) for p in res.points]}
        )
        for res in r.results
        if res.collective == "all_reduce"
    ]
    config = r.config.model_copy(update={"collectives": [*r.config.collectives, collective]})
    return r.model_copy(update={"results": [*r.results, *more], "config": config})


def with_send_recv(r: bench.BenchReport, busbw: float = 3.0) -> bench.BenchReport:
    return with_collective(r, "send_recv", busbw)


def test_send_recv_round_trips_and_old_reports_still_load(tmp_path: Path) -> None:
    r = with_send_recv(make_report())
    path = tmp_path / "bench.json"
    bench.dump_bench(r, path)
    back = bench.load_bench(path)
    assert back == r and back.config.collectives == ["all_reduce", "send_recv"]
    assert back.busbw_gbytes_s("intra_node", "send_recv", 16 * MiB) == pytest.approx(3.0)
    assert json.loads(path.read_text())["results"][-1]["collective"] == "send_recv"
    # a report written before the send_recv sweep (as version 1 always was): loads, and says it has none
    old = json.loads(make_report().model_dump_json(by_alias=True))
    assert all(res["collective"] != "send_recv" for res in old["results"])
    path.write_text(json.dumps(old))
    assert bench.load_bench(path).result("world", "send_recv") is None


def with_sweep(r: bench.BenchReport, collective: str, busbw: dict[str, float]) -> bench.BenchReport:
    """`r` plus a `collective` sweep on each group of `busbw` (GB/s at every size, by group) its all-reduce swept."""

    def point(n: int, size: int, bw: float) -> bench.SizePoint:
        return bench.SizePoint.measured(collective, n, size, [size * collectives.bus_factor(collective, n) / bw / 1e9])

    more = [
        res.model_copy(
            update={
                "collective": collective,
                "points": [point(res.ranks_per_group, p.size_bytes, bw) for p in res.points],
            }
        )
        for res in r.results
        if res.collective == "all_reduce" and (bw := busbw.get(res.group))
    ]
    return r.model_copy(update={"results": [*r.results, *more]})


def with_p2p(r: bench.BenchReport, busbw: dict[str, float]) -> bench.BenchReport:
    return with_sweep(r, "send_recv", busbw)


def test_p2p_bandwidth_reads_the_links_a_pipeline_stage_send_crosses(tmp_path: Path) -> None:
    """Inside a node: the intra-node groups' send/recv (a single node's world); between nodes: the inter-node
    groups' (a world ring that crosses nodes where there are none); None where nothing was measured, and for every
    report written before the sweep, which still loads."""
    two = with_p2p(make_report(), {"world": 0.4, "intra_node": 3.0, "inter_node": 0.5})
    assert bench.p2p_bandwidth(two, inter_node=False) == pytest.approx(3.0)
    assert bench.p2p_bandwidth(two, inter_node=True, size_bytes=8 * MiB) == pytest.approx(0.5)
    one = with_p2p(make_report(nodes=1), {"world": 2.0})
    assert bench.p2p_bandwidth(one, inter_node=False) == pytest.approx(2.0)
    assert bench.p2p_bandwidth(one, inter_node=True) is None  # no node boundary to cross
    # several nodes, only the world group (one rank per node, or nodes of uneven size): its ring crosses nodes
    world = two.model_copy(update={"results": [x for x in two.results if x.group == "world"]})
    assert bench.p2p_bandwidth(world, inter_node=True) == pytest.approx(0.4)
    assert bench.p2p_bandwidth(world, inter_node=False) is None
    path = tmp_path / "old.json"
    path.write_text(json.dumps(json.loads(make_report().model_dump_json(by_alias=True))))
    old = bench.load_bench(path)
    assert bench.p2p_bandwidth(old, inter_node=False) is None and bench.p2p_bandwidth(old, inter_node=True) is None
    from llmctl.netbench.render import p2p_line

    assert p2p_line(old) is None
    assert p2p_line(two) == (
        "P2P send/recv between pipeline stages (busbw = algbw, peak): inside a node 3.000 GB/s at 4 MiB; "
        "between nodes 0.500 GB/s at 4 MiB"
    )


def test_plan_network_reads_measured_send_recv_and_falls_back_to_all_gather(tmp_path: Path) -> None:
    from llmctl.plan.network import bench_network

    old = with_collective(make_report(), "all_gather", 1.5)
    new = with_send_recv(old, 3.0)
    old_path, new_path = tmp_path / "old.json", tmp_path / "new.json"
    bench.dump_bench(old, old_path)
    bench.dump_bench(new, new_path)
    net = bench_network(str(new_path), 2, 2, None, None)
    assert net.busbw("send_recv", "intra", 16 * MiB, 2) == pytest.approx(3.0)  # measured, not a stand-in
    assert net.busbw("send_recv", "cross", 16 * MiB, 2) == pytest.approx(3.0)
    assert net.busbw("send_recv", "inter", 16 * MiB, 2) == pytest.approx(3.0)
    assert net.busbw("all_reduce", "intra", 16 * MiB, 2) == pytest.approx(4.0)  # the others as before
    assert "not measured" not in net.source
    net_old = bench_network(str(old_path), 2, 2, None, None)
    for scope in ("intra", "cross", "inter"):
        assert net_old.busbw("send_recv", scope, 16 * MiB, 2) == pytest.approx(1.5)  # all_gather's, not all_reduce's
    assert net_old.source == f"bench-net {old_path}; send_recv read as all_gather (not measured)"
    # a report with neither reads the all-reduce, as for any other collective it lacks, and says so
    bench.dump_bench(make_report(), old_path)
    bare = bench_network(str(old_path), 2, 2, None, None)
    assert bare.busbw("send_recv", "intra", 16 * MiB, 2) == pytest.approx(4.0)
    assert "send_recv read as all_reduce (not measured)" in bare.source


def test_alltoall_bandwidth_reads_the_links_an_expert_parallel_group_crosses() -> None:
    """As the send/recv's: inside a node the intra-node groups' all-to-all, between nodes the inter-node groups' (both
    local ranks exchanging at once); None without the sweep. The report prints both peaks on one line."""
    from llmctl.netbench.render import alltoall_line

    two = with_sweep(make_report(), "all_to_all", {"world": 0.4, "intra_node": 3.0, "inter_node": 0.5})
    assert two.result("intra_node", "all_to_all").points[0].algbw_gbytes_s == pytest.approx(6.0)  # busbw / (1/2)
    assert bench.alltoall_bandwidth(two, inter_node=False) == pytest.approx(3.0)
    assert bench.alltoall_bandwidth(two, inter_node=True, size_bytes=8 * MiB) == pytest.approx(0.5)
    assert bench.alltoall_bandwidth(make_report(), inter_node=False) is None
    assert bench.alltoall_result(with_p2p(make_report(), {"intra_node": 3.0}), inter_node=False) is None
    assert alltoall_line(make_report()) is None
    assert alltoall_line(two) == (
        "all-to-all for expert parallelism (busbw, peak): inside a node 3.000 GB/s at 4 MiB; "
        "between nodes 0.500 GB/s at 4 MiB"
    )


def test_alltoall_time_reads_the_measured_sweeps_or_the_all_gather(tmp_path: Path) -> None:
    """2 nodes x 2 GPUs, ep 4 (2 ranks per node), S = 16 MiB per rank: a quarter of S to the node-mate, half of it
    off the node, alpha 8 us x 3 messages."""
    from llmctl.plan.network import alltoall_time, bench_network

    s = 16 * MiB  # 16777216 bytes
    new = with_sweep(make_report(), "all_to_all", {"world": 0.4, "intra_node": 3.0, "inter_node": 0.5})
    old = with_collective(make_report(), "all_gather", 1.5)
    new_path, old_path = tmp_path / "new.json", tmp_path / "old.json"
    bench.dump_bench(new, new_path)
    bench.dump_bench(old, old_path)
    net = bench_network(str(new_path), 2, 2, None, None)
    # NVLink 4194304 B / 3.0 GB/s = 1.398 ms; NICs 8388608 B / 0.5 GB/s = 16.777216 ms, the longer; + 24 us
    assert alltoall_time(net, s, 4, 2) == pytest.approx(0.016777216 + 24e-6)
    # inside one node: half of S to the node-mate at the intra-node sweep's 3.0 GB/s, + 2 us (intra alpha) x 1
    assert alltoall_time(net, s, 2, 2) == pytest.approx(8388608 / 3.0e9 + 2e-6)
    net_old = bench_network(str(old_path), 2, 2, None, None)
    # no all-to-all sweep: the all-gather's 1.5 GB/s on both links; NICs 8388608 / 1.5e9 = 5.592405 ms
    assert alltoall_time(net_old, s, 4, 2) == pytest.approx(8388608 / 1.5e9 + 24e-6)
    # the network line names only the stand-ins every plan reads (no all-to-all without experts)
    assert net_old.source == f"bench-net {old_path}; send_recv read as all_gather (not measured)"


def test_loader_gives_the_planner_intra_and_inter_node_busbw(tmp_path: Path) -> None:
    r = make_report()
    assert r.intra_node_busbw_gbytes_s(16 * MiB) == pytest.approx(4.0)
    assert r.intra_node_busbw_gbytes_s(8 * MiB) == pytest.approx(3.0)  # halfway in log2(size) from 4 to 16 MiB
    assert r.intra_node_busbw_gbytes_s(1 * MiB) == pytest.approx(2.0)  # clamped below the range
    assert r.inter_node_busbw_gbytes_s(32 * MiB) == pytest.approx(0.06)
    assert r.inter_node_busbw_gbytes_s(32 * MiB, per_node=True) == pytest.approx(0.12)
    single = make_report(nodes=1)
    assert single.inter_node_busbw_gbytes_s() is None
    assert single.intra_node_busbw_gbytes_s(64 * MiB) == pytest.approx(0.06)  # the world is the node
    with pytest.raises(SpecError, match="no world/all_gather result"):
        r.busbw_gbytes_s("world", "all_gather")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON: Expecting property name"),
        ("[1, 2]", "expected a JSON object"),
        ('{"schema": "something-else"}', "schema is 'something-else'"),
        ('{"schema": "llmctl.bench-net", "schema_version": 9}', "schema_version 9"),
        ('{"schema": "llmctl.bench-net", "schema_version": 1}', "invalid bench-net report at created_utc"),
    ],
)
def test_malformed_json_is_one_clear_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SpecError) as e:
        bench.load_bench(path)
    assert message in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def test_invalid_field_and_missing_file(tmp_path: Path) -> None:
    data = json.loads(make_report().model_dump_json(by_alias=True))
    data["results"][0]["points"][0]["size_bytes"] = -5
    path = tmp_path / "neg.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"results\.0\.points\.0\.size_bytes: Input should be greater than 0"):
        bench.load_bench(path)
    with pytest.raises(SpecError, match="no such bench-net report"):
        bench.load_bench(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------- options, CLI


def test_parse_sizes() -> None:
    assert opts.parse_sizes("1MiB..8MiB") == [MiB, 2 * MiB, 4 * MiB, 8 * MiB]
    assert opts.parse_sizes("1M..64M:4") == [MiB, 4 * MiB, 16 * MiB, 64 * MiB]
    assert opts.parse_sizes("16M,1M,4096") == [4096, MiB, 16 * MiB]
    assert len(opts.parse_sizes(opts.DEFAULT_SIZES_GPU)) == 11  # 1 MiB .. 1 GiB by 2
    for bad in ("0", "-1M", "1Q", "8M..1M", "1M..8M:1", ""):
        with pytest.raises(InputError):
            opts.parse_sizes(bad)


def test_parse_dtype_and_collectives() -> None:
    assert opts.parse_dtype("bf16") == "bfloat16"
    assert opts.parse_collectives("reduce_scatter_tensor,all_reduce") == ["all_reduce", "reduce_scatter"]
    assert opts.parse_collectives("sendrecv,send-recv,all_gather") == ["all_gather", "send_recv"]
    assert opts.parse_collectives("alltoall,all_to_all_single,all-to-all") == ["all_to_all"]
    swept = opts.WorkerConfig(json_path="x").collectives.split(",")
    assert swept[-2:] == ["send_recv", "all_to_all"]  # swept by default
    with pytest.raises(InputError, match="choose fp32, bf16 or fp16"):
        opts.parse_dtype("int8")
    with pytest.raises(InputError, match="unknown collective broadcast"):
        opts.parse_collectives("broadcast")


def test_dist_env_from_torchrun_and_srun() -> None:
    e = opts.dist_env(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    assert (e.rank, e.node_rank, e.local_world_size, e.agent_store, e.launcher) == (3, 1, 2, True, "torchrun")
    s = opts.dist_env(
        {
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_TASKS_PER_NODE": "4(x2)",
            "MASTER_ADDR": "n1",
        }
    )
    assert (s.rank, s.world_size, s.local_world_size, s.node_rank, s.master_addr) == (5, 8, 4, 1, "n1")
    assert opts.inside_launcher({}) is None
    with pytest.raises(InputError, match="not inside torchrun or srun"):
        opts.dist_env({})


def test_recorded_env_never_keeps_secrets() -> None:
    env = {"NCCL_IB_HCA": "mlx5", "GLOO_SOCKET_IFNAME": "fab0", "NCCL_API_KEY": "x", "HF_TOKEN": "y", "HOME": "/"}
    assert opts.recorded_env(env) == {"GLOO_SOCKET_IFNAME": "fab0", "NCCL_IB_HCA": "mlx5"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes", "0"], "message size must be positive"),
        (["--sizes", "-4M"], "bad message size"),
        (["--dtype", "int4"], "unknown dtype 'int4'"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
        (["--slow-fraction", "1.5"], "--slow-fraction must be between 0 and 1"),
        (["--expect-gbps", "-3"], "--expect-gbps must be positive"),
        (["-o", "/nonexistent/dir/x.json"], "does not exist"),
        (["--json", "x.json"], "unexpected extra argument"),  # --json is a flag (print), -o takes the file
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args: list[str], message: str) -> None:
    res = CliRunner().invoke(app, ["bench-net", *args])
    assert res.exit_code == 2, res.output
    out = res.output.strip()
    assert out.startswith("llmctl: error:") and message in out and "Traceback" not in out
    assert len(out.splitlines()) == 1


def test_torchrun_command_is_launch_module_argv() -> None:
    from llmctl.launch.bench_net import WORKER_MODULE, torchrun_argv
    from llmctl.launch.local import Rendezvous

    cfg = opts.WorkerConfig(json_path="/tmp/b.json", sizes="1M", timeout_s=60)
    one = torchrun_argv(cfg, 2, Rendezvous(master_port=29511, timeout_s=60))
    assert one[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in one and "--nproc_per_node=2" in one and "--max_restarts=0" in one
    module_at = one.index("--module")
    assert one[module_at + 1] == WORKER_MODULE == "llmctl.netbench.worker"
    assert one[module_at + 2 :] == [*cfg.to_argv(), "--no-render"]
    two = torchrun_argv(cfg, 8, Rendezvous(2, 1, "10.0.0.1", 29511, timeout_s=60))
    for arg in ("--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29511"):
        assert arg in two
    assert "--rdzv_conf=timeout=60" in two and "--standalone" not in two


def test_sizes_print_with_the_one_byte_formatter() -> None:
    from llmctl.units import fmt_bytes

    assert [fmt_bytes(b) for b in (512, 256 * 1024, MiB, 1048572, 3 * 2**29)] == [
        "512 B",
        "256 KiB",
        "1 MiB",
        "1024 KiB",  # 3 ranks x fp32: 1 MiB rounded down to split evenly
        "1.5 GiB",
    ]


def test_cli_and_report_stay_torch_free() -> None:
    # (the help's exit code is main.py's business; here only: help shows our options, nothing imported torch)
    code = (
        "import sys, llmctl.cli.main, llmctl.netbench.report, llmctl.netbench.render; "
        "from typer.testing import CliRunner; run = CliRunner().invoke; app = llmctl.cli.main.app; "
        "r = run(app, ['bench-net', '--help']); assert '--nproc-per-node' in r.output, r.output; "
        "r = run(app, ['bench-net', '--sizes', '0']); assert r.exit_code == 2, r.output; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_render_and_plot(tmp_path: Path) -> None:
    from rich.console import Console

    from llmctl.netbench import render

    r = make_report()
    console = Console(record=True, width=140)
    render.render(r, console)
    text = console.export_text()
    assert "inter_node all_reduce" in text and "0.060" in text and "0.96" in text  # per node: 2 x 0.06 GB/s
    ok, msg = render.check_expectation(r, 0.9)
    assert ok and msg.startswith("PASS") and "0.96 Gbit/s" in msg
    assert not render.check_expectation(r, 1.0)[0]
    render.plot(r, tmp_path / "bw.png")
    assert (tmp_path / "bw.png").read_bytes()[:4] == b"\x89PNG"


def test_two_nodes_are_never_flagged() -> None:
    links = [bench.LinkResult(a="a", b="b", size_bytes=MiB, busbw_gbytes_s=0.01)]
    judged, verdicts = rp.judge_nodes(["a", "b"], links, {"a": 5.0, "b": 0.5}, 0.7)
    assert not any(v.slow for v in verdicts) and not judged[0].slow
