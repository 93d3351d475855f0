"""bench-net with real torchrun processes on gloo (CPU): valid JSON, busbw consistent with algbw, hangs named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from netbench_helpers import LLMCTL, free_port, run_env

from llmctl.spec.bench import BenchReport, alltoall_bandwidth, load_bench, p2p_bandwidth
from llmctl.spec.collectives import bus_factor

pytestmark = pytest.mark.dist


def check_consistent(r: BenchReport) -> None:
    for res in r.results:
        for p in res.points:
            t = p.time_s
            assert 0 < t.min <= t.p10 <= t.median <= t.p90 <= t.max
            assert p.algbw_gbytes_s == pytest.approx(p.size_bytes / t.median / 1e9)
            assert p.busbw_gbytes_s == pytest.approx(p.algbw_gbytes_s * bus_factor(res.collective, res.ranks_per_group))
            assert p.busbw_gbytes_s_min <= p.busbw_gbytes_s <= p.busbw_gbytes_s_max
            assert p.size_bytes % (res.ranks_per_group * 4) == 0  # fp32, splits evenly across ranks
            if res.collective == "send_recv":  # nccl-tests sendrecv_perf: busbw = algbw = S / t, S what a rank sends
                assert p.busbw_gbytes_s == pytest.approx(p.size_bytes / t.median / 1e9)


def test_two_ranks_all_collectives_json_plot_and_failed_expectation(tmp_path: Path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [
            *LLMCTL,
            "bench-net",
            "--nproc-per-node",
            "2",
            "--sizes",
            "256K,1M",
            "--iters",
            "3",
            "--warmup",
            "1",
            "-o",
            str(out),
            "--plot",
            str(png),
            "--expect-gbps",
            "100000",
            "--timeout",
            "60",
        ],
        env=run_env(tmp_path, GLOO_SOCKET_IFNAME="lo", NCCL_DEBUG="WARN"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    # the sweep ran and was written; then --expect-gbps turned the summary into a failure: exit 1, one line
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert len(err) == 1 and "FAIL: all-reduce busbw peak" in err[0] and "Traceback" not in proc.stderr
    assert "world all_reduce" in proc.stdout and "summary" in proc.stdout
    r = load_bench(out)
    assert r.world_size == 2 and r.backend == "gloo" and r.dtype == "float32" and len(r.nodes) == 1
    assert {(x.group, x.collective) for x in r.results} == {
        ("world", "all_reduce"),
        ("world", "all_gather"),
        ("world", "reduce_scatter"),
        ("world", "send_recv"),
        ("world", "all_to_all"),
    }
    # the ring send/recv is reported like the collectives: the requested sizes, its own table and summary row
    sr = r.result("world", "send_recv")
    assert sr is not None and [p.size_bytes for p in sr.points] == [256 * 1024, 2**20]
    assert "world send_recv" in proc.stdout
    print("loopback busbw GB/s at 1 MiB:", {x.collective: round(x.points[-1].busbw_gbytes_s, 3) for x in r.results})
    # what the planner prices a pipeline stage's send with: one node, so inside it only
    assert p2p_bandwidth(r, inter_node=False, size_bytes=2**20) == sr.points[-1].busbw_gbytes_s > 0
    assert p2p_bandwidth(r, inter_node=True) is None
    assert "P2P send/recv between pipeline stages (busbw = algbw, peak): inside a node" in proc.stdout
    # the all-to-all (all_to_all_single, even splits, on gloo): checked, timed, busbw = algbw x 1/2 on 2 ranks
    a2a = r.result("world", "all_to_all")
    assert a2a is not None and [p.size_bytes for p in a2a.points] == [256 * 1024, 2**20]
    assert a2a.points[-1].busbw_gbytes_s == pytest.approx(a2a.points[-1].algbw_gbytes_s / 2)
    assert "world all_to_all" in proc.stdout and "all-to-all for expert parallelism (busbw, peak)" in proc.stdout
    assert alltoall_bandwidth(r, inter_node=False, size_bytes=2**20) == a2a.points[-1].busbw_gbytes_s > 0
    assert r.env["GLOO_SOCKET_IFNAME"] == "lo" and r.env["NCCL_DEBUG"] == "WARN"
    assert r.versions["torch"].startswith("2.")
    assert [p.size_bytes for p in r.results[0].points] == [256 * 1024, 2**20]
    assert all(p.iters == 3 for res in r.results for p in res.points)
    check_consistent(r)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_four_ranks_as_two_nodes_on_loopback(tmp_path: Path) -> None:
    """Two `llmctl bench-net --nnodes 2 --json -o FILE` commands (node names from LLMCTL_NODE_NAME): world,
    intra-node, inter-node groups and the pairwise link test; node rank 0 prints the report it wrote."""
    out, port = tmp_path / "bench.json", free_port()
    procs = [
        subprocess.Popen(
            [
                *LLMCTL,
                "bench-net",
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--nproc-per-node",
                "2",
                "--sizes",
                "1M",
                "--iters",
                "3",
                "--warmup",
                "1",
                "--collectives",
                "all_reduce,reduce_scatter,send_recv,alltoall",
                "--json",
                "-o",
                str(out),
                "--expect-gbps",
                "0.001",
                "--timeout",
                "60",
                "--no-progress",
            ],
            env=run_env(tmp_path, LLMCTL_NODE_NAME=f"box{i}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    # stdout is the JSON only (the file's text); node rank 1 has no report, so its stdout is empty
    assert outs[0][0] == out.read_text() and outs[1][0] == "" and "node rank 1 done" in outs[1][1]
    r = load_bench(out)
    assert r.hosts == ["box0", "box1"] and r.ranks_per_node == 2 and r.world_size == 4
    assert [n.ranks for n in r.nodes] == [[0, 1], [2, 3]]
    groups = {(x.group, x.collective): x for x in r.results}
    assert set(groups) == {
        (g, c)
        for g in ("world", "intra_node", "inter_node")
        for c in ("all_reduce", "reduce_scatter", "send_recv", "all_to_all")
    }
    # the ring send/recv in subgroups of non-adjacent global ranks ({0, 2} and {1, 3}): checked, then timed
    sr = groups[("inter_node", "send_recv")]
    assert (sr.ranks_per_group, sr.concurrent_groups) == (2, 2) and set(sr.per_group_busbw_gbytes_s) == {
        "local0",
        "local1",
    }
    inter = groups[("inter_node", "all_reduce")]
    assert (inter.ranks_per_group, inter.concurrent_groups, inter.groups_per_node) == (2, 2, 2)
    assert set(groups[("intra_node", "all_reduce")].per_group_busbw_gbytes_s) == {"box0", "box1"}
    assert [(lk.a, lk.b) for lk in r.links] == [("box0", "box1")]
    assert r.intra_node_busbw_gbytes_s() > 0 and r.inter_node_busbw_gbytes_s() > 0
    # a pipeline stage's send: inside a node the intra-node ring's, between nodes the inter-node groups' (both local
    # ranks of a node sending at once, as a stage's ranks do)
    assert p2p_bandwidth(r, inter_node=False) == groups[("intra_node", "send_recv")].points[0].busbw_gbytes_s > 0
    assert p2p_bandwidth(r, inter_node=True) == sr.points[0].busbw_gbytes_s > 0
    # an expert-parallel group's all-to-all across nodes: the inter-node groups' ({0, 2} and {1, 3} at once)
    assert alltoall_bandwidth(r, inter_node=True) == groups[("inter_node", "all_to_all")].points[0].busbw_gbytes_s > 0
    print(
        "loopback all-to-all GB/s at 1 MiB:",
        {
            g: round(groups[(g, "all_to_all")].points[0].busbw_gbytes_s, 3)
            for g in ("world", "intra_node", "inter_node")
        },
    )
    print(
        "loopback send/recv GB/s at 1 MiB:",
        {g: round(groups[(g, "send_recv")].points[0].busbw_gbytes_s, 3) for g in ("world", "intra_node", "inter_node")},
    )
    check_consistent(r)


def test_inside_torchrun_runs_in_process(tmp_path: Path) -> None:
    """`torchrun ... -m llmctl.cli.main bench-net --json` (as under srun): every rank runs the worker itself;
    rank 0 prints the JSON report, and stdout holds nothing else."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "-m",
            "llmctl.cli.main",
            "bench-net",
            "--sizes",
            "512K",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--collectives",
            "all_gather",
            "--json",
            "--timeout",
            "60",
            "--no-progress",
        ],
        env=run_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "stdout.json"
    out.write_text(proc.stdout)
    r = load_bench(out)  # the whole of stdout is one valid, versioned report
    assert r.world_size == 4 and r.results[0].ranks_per_group == 4
    check_consistent(r)


def test_a_rank_that_never_joins_is_named(tmp_path: Path) -> None:
    """World of 3, only ranks 0 and 1 started: both fail within the timeout and name rank 2."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = run_env(
            tmp_path,
            RANK=str(rank),
            WORLD_SIZE="3",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "llmctl.netbench.worker",
                    "-o",
                    str(tmp_path / "x.json"),
                    "--timeout",
                    "4",
                    "--sizes",
                    "1M",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 1, err
        assert "rank 2 (node rank 2) never joined within 4 s" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_sum_check_survives_16_bit_rounding() -> None:
    import torch

    from llmctl.netbench.calls import _sum_of_ones_ok
    from llmctl.netbench.worker import calls_per_iter

    assert _sum_of_ones_ok(torch.full((8,), 4.0, dtype=torch.bfloat16), 4, 0)
    assert not _sum_of_ones_ok(torch.full((8,), 3.0, dtype=torch.bfloat16), 4, 0)
    stalled = torch.full((8,), 256.0, dtype=torch.bfloat16)  # 512 ones summed in bf16 by a ring
    assert _sum_of_ones_ok(stalled, 512, 0)
    assert not _sum_of_ones_ok(torch.full((8,), 512.0), 513, 0)  # fp32 is exact there
    assert (calls_per_iter(2**20, False), calls_per_iter(2**26, False), calls_per_iter(2**30, True)) == (10, 1, 1)


def test_a_node_that_never_joins_is_one_line(tmp_path: Path) -> None:
    """Node rank 0 alone with --nnodes 2: torchrun's rendezvous times out; one line says so, no traceback."""
    proc = subprocess.run(
        [
            *LLMCTL,
            "bench-net",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-port",
            str(free_port()),
            "--nproc-per-node",
            "1",
            "--sizes",
            "1M",
            "--timeout",
            "4",
            "--no-progress",
        ],
        env=run_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert (
        proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[0]]
        and "only 1 of 2 nodes joined the rendezvous" in proc.stderr
    )


def test_inside_srun_runs_in_process(tmp_path: Path) -> None:
    """Two tasks with the variables srun sets (2 nodes x 1 task): each runs the worker, task 0 reports."""
    out, port = tmp_path / "bench.json", free_port()
    procs = []
    for rank in (0, 1):
        env = run_env(
            tmp_path,
            SLURM_STEP_ID="0",
            SLURM_PROCID=str(rank),
            SLURM_NTASKS="2",
            SLURM_LOCALID="0",
            SLURM_NODEID=str(rank),
            SLURM_TASKS_PER_NODE="1(x2)",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LLMCTL_NODE_NAME=f"slurmnode{rank}",
        )
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(k, None)
        procs.append(
            subprocess.Popen(
                [
                    *LLMCTL,
                    "bench-net",
                    "--sizes",
                    "1M",
                    "--iters",
                    "2",
                    "--warmup",
                    "0",
                    "--collectives",
                    "all_reduce",
                    "-o",
                    str(out),
                    "--timeout",
                    "60",
                    "--no-progress",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "world all_reduce" in outs[0][0] and outs[1][0] == ""
    r = load_bench(out)
    assert r.hosts == ["slurmnode0", "slurmnode1"] and [lk.a for lk in r.links] == ["slurmnode0"]


def test_a_rank_that_hangs_mid_sweep_is_named(tmp_path: Path) -> None:
    """Rank 1 frozen (SIGSTOP) during the sweep: rank 0 gives up after --timeout and names rank 1 and its node."""
    import signal
    import time

    port = free_port()
    procs = []
    try:
        for rank in (0, 1):
            env = run_env(
                tmp_path,
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
                GROUP_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                LLMCTL_NODE_NAME=f"host{rank}",
            )
            env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "llmctl.netbench.worker",
                        "-o",
                        str(tmp_path / "x.json"),
                        "--sizes",
                        "1M..64M",
                        "--iters",
                        "50",
                        "--timeout",
                        "6",
                        "--no-progress",
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        time.sleep(8)  # imports, check-in, the first sizes
        procs[1].send_signal(signal.SIGSTOP)
        start = time.monotonic()
        _, err = procs[0].communicate(timeout=90)
        waited = time.monotonic() - start
    finally:
        for p in procs:  # our own children, by handle
            if p.poll() is None:
                p.kill()
            p.wait()
    assert procs[0].returncode == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("llmctl: error:") and "rank 1" in line, err
    assert "on host1 did not finish it" in line or "never joined" in line
    assert waited < 6 + 30
