"""The preflight's decision (which nodes train, which are dropped and why, when the job stops), its options on the
command line, the events it leaves for `llmctl status`, and the torchrun commands its agents run. No SLURM, no
torch: the real jobs are tests/launch/test_preflight_slurm.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from launch_helpers import minimal_plan_yaml
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import InputError
from llmctl.launch import jobs
from llmctl.launch.preflight import decision as pf
from llmctl.launch.preflight import node, requeue
from llmctl.launch.preflight.main import main as preflight_main
from llmctl.launch.preflight.options import PreflightOptions
from llmctl.netbench import report as rp
from llmctl.spec import bench as bn

MiB = 2**20
NODES = ["node1", "node2", "node3"]


def ok(node: str, intra: float | None = None) -> pf.NodeCheck:
    return pf.NodeCheck(node=node, ok=True, device="cpu", ranks=2, intra_busbw_gbytes_s=intra, seconds=1.0)


def bench(nodes: list[str], links: dict[tuple[str, str], float], world_busbw: float = 1.0) -> bn.BenchReport:
    """A quick bench across `nodes` (one rank each), judged by bench-net's own rules."""
    size = 16 * MiB
    pts = [bn.SizePoint.measured("all_reduce", len(nodes), size, [size / (world_busbw * 1e9)] * 3)]
    # busbw = algbw x 2(n-1)/n: undo the factor so that the point's busbw is world_busbw
    pts = [p.model_copy(update={"busbw_gbytes_s": world_busbw}) for p in pts]
    link_results = [bn.LinkResult(a=a, b=b, size_bytes=size, busbw_gbytes_s=bw) for (a, b), bw in links.items()]
    judged, verdicts = rp.judge_nodes(nodes, link_results, {}, pf.SLOW_FRACTION)
    return bn.BenchReport(
        created_utc="2026-11-25T00:00:00+00:00",
        backend="gloo",
        device="cpu",
        dtype="float32",
        world_size=len(nodes),
        ranks_per_node=1,
        nodes=[bn.NodeInfo(name=n, node_rank=i, ranks=[i]) for i, n in enumerate(nodes)],
        versions={},
        env={},
        config=bn.BenchConfig(sizes_bytes=[size], iters=3, warmup=1, collectives=["all_reduce"], slow_fraction=0.7),
        results=[
            bn.CollectiveResult(
                group="world",
                collective="all_reduce",
                ranks_per_group=len(nodes),
                concurrent_groups=1,
                groups_per_node=1,
                points=pts,
            )
        ],
        links=judged,
        node_verdicts=verdicts,
    )


# ---------------------------------------------------------------------------------------------- decide


def test_healthy_nodes_all_train() -> None:
    d = pf.decide(NODES[:2], 2, {n: ok(n) for n in NODES[:2]}, bench(NODES[:2], {("node1", "node2"): 1.0}))
    assert d.ok and d.train == ["node1", "node2"] and d.dropped == {} and d.warnings == []
    assert d.measured == {"inter_node_busbw_gbytes_s": pytest.approx(1.0)}


def test_failed_node_is_replaced_by_the_spare() -> None:
    checks = {n: ok(n) for n in NODES}
    checks["node2"] = pf.NodeCheck(node="node2", ok=False, error="no GPU visible")
    d = pf.decide(NODES, 2, checks, bench(["node1", "node3"], {("node1", "node3"): 1.0}))
    assert d.ok and d.train == ["node1", "node3"]
    assert d.dropped == {"node2": "failed: no GPU visible"}
    assert pf.summary(d) == "training on node1,node3; dropped node2 (failed: no GPU visible)"


def test_failed_node_without_spare_stops_naming_it() -> None:
    checks = {"node1": ok("node1"), "node2": pf.NodeCheck(node="node2", ok=False, error="boom")}
    d = pf.decide(NODES[:2], 2, checks)
    assert not d.ok and d.train == []
    assert d.failure == (
        "node2 failed: boom; 1 of 2 nodes left, the plan needs 2 "
        "(relaunch with node2 in --exclude, or with --spare-nodes 1)"
    )


def test_a_node_that_never_answered_is_failed() -> None:
    d = pf.decide(NODES[:2], 1, {"node1": ok("node1")})
    assert d.ok and d.train == ["node1"] and d.dropped == {"node2": "failed: no answer"}


def test_slow_node_by_bench_net_rules_is_dropped_first() -> None:
    # node3's links are 4x slower than the others': bench-net's best-link rule names node3, not its partners
    links = {("node1", "node2"): 1.0, ("node1", "node3"): 0.25, ("node2", "node3"): 0.24}
    d = pf.decide(NODES, 2, {n: ok(n) for n in NODES}, bench(NODES, links))
    assert d.ok and d.train == ["node1", "node2"]
    assert d.dropped["node3"].startswith("slow: best inter-node link 0.25 GB/s < 0.7 x median")


def test_slow_node_without_spare_stops() -> None:
    links = {("node1", "node2"): 1.0, ("node1", "node3"): 0.25, ("node2", "node3"): 0.24}
    d = pf.decide(NODES, 3, {n: ok(n) for n in NODES}, bench(NODES, links))
    assert not d.ok and d.failure.startswith("node3 slow: best inter-node link")
    assert (
        "2 of 3 nodes left, the plan needs 3 (relaunch with node3 in --exclude, or with --spare-nodes 1)" in d.failure
    )


def test_slow_intra_node_all_reduce_is_a_slow_node() -> None:
    checks = {"node1": ok("node1", 5.0), "node2": ok("node2", 1.0), "node3": ok("node3", 5.2)}
    d = pf.decide(NODES, 2, checks, bench(NODES, {}))
    assert d.train == ["node1", "node3"] and d.dropped["node2"].startswith("slow: intra-node all-reduce 1 GB/s")


def test_spares_drop_the_worst_of_the_healthy() -> None:
    links = {("node1", "node2"): 1.0, ("node1", "node3"): 0.9, ("node2", "node3"): 0.8}  # nobody slow (0.7 rule)
    d = pf.decide(NODES, 2, {n: ok(n) for n in NODES}, bench(NODES, links))
    assert d.train == ["node1", "node2"]
    assert d.dropped == {"node3": "spare, the worst of the rest: best link 0.9 GB/s"}
    # unmeasured (one rank per node, one node needed: no cross step): the latest in the allocation goes
    d = pf.decide(NODES[:2], 1, {n: ok(n) for n in NODES[:2]})
    assert d.train == ["node1"] and d.dropped == {"node2": "spare, the worst of the rest"}


def test_bandwidth_below_the_plan_warns_or_stops_when_strict() -> None:
    checks = {n: ok(n, 2.0) for n in NODES[:2]}
    b = bench(NODES[:2], {("node1", "node2"): 1.0}, world_busbw=1.0)
    assumed = pf.Assumed(intra_busbw_gbytes_s=10.0, inter_node_busbw_gbytes_s=1.2)
    d = pf.decide(NODES[:2], 2, checks, b, assumed=assumed)
    assert d.ok and d.train == ["node1", "node2"]
    assert d.warnings == [
        "intra-node all-reduce busbw 2 GB/s (16 Gbit/s) per GPU, 0.20 x the plan's 10 GB/s (80 Gbit/s): "
        "the run will be slower than the plan predicts"
    ]  # inter-node 1.0 of 1.2 GB/s is within the 0.7 rule: no warning
    d = pf.decide(NODES[:2], 2, checks, b, assumed=assumed, strict=True)
    assert not d.ok and d.failure.startswith("intra-node all-reduce busbw 2 GB/s") and "--preflight-strict" in d.failure
    # no assumption in the plan: nothing compared, nothing said
    assert pf.decide(NODES[:2], 2, checks, b, strict=True).warnings == []
    # 8 of the plan's 10 GB/s inside a node is within the 0.7 rule as well: measured and compared, nothing said
    d = pf.decide(NODES[:2], 2, {n: ok(n, 8.0) for n in NODES[:2]}, b, assumed=assumed, strict=True)
    assert d.ok and d.warnings == [] and d.measured["intra_busbw_gbytes_s"] == 8.0


def test_plan_assumptions_come_from_the_written_plan() -> None:
    from llmctl.spec.planfile import Predicted

    plan = SimpleNamespace(predicted=Predicted(tokens_per_s=1.0))  # a hand-written plan: no bandwidth
    assert pf.plan_assumptions(plan) == pf.Assumed()  # type: ignore[arg-type]
    plan = SimpleNamespace(predicted=Predicted(intra_node_busbw_gbytes_s=150.0, inter_node_busbw_gbytes_s=40.0))
    assert pf.plan_assumptions(plan) == pf.Assumed(150.0, 40.0)  # type: ignore[arg-type]


def test_llmctl_plan_records_the_bandwidth_it_assumed(tmp_path) -> None:
    from typer.testing import CliRunner

    from llmctl.cli.main import app
    from llmctl.spec.planfile import load_plan

    out = tmp_path / "plan.yaml"
    args = ["plan", "llama-3.1-8b", "--gpu", "H100-SXM", "--nodes", "2", "--gpus-per-node", "8"]
    r = CliRunner().invoke(app, [*args, "--inter-gbps", "400", "--strategy", "hybrid_shard", "-o", str(out)])
    assert r.exit_code == 0, r.output
    p = load_plan(out).predicted
    assert p.inter_node_busbw_gbytes_s == pytest.approx(50.0)  # 400 Gbit/s per node
    assert p.intra_node_busbw_gbytes_s and p.intra_node_busbw_gbytes_s > 100  # NVLink, x efficiency
    assert pf.plan_assumptions(load_plan(out)) == pf.Assumed(p.intra_node_busbw_gbytes_s, 50.0)


def test_cross_step_failure_stops() -> None:
    d = pf.decide(NODES[:2], 2, {n: ok(n) for n in NODES[:2]}, cross_error="rank 1 never joined within 60 s")
    assert d.failure == "the all-reduce across node1,node2 failed: rank 1 never joined within 60 s"


# ---------------------------------------------------------------------------------------------- options, CLI


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"spare_nodes": -1}, "--spare-nodes -1: must be between 0"),
        ({"spare_nodes": 100_001}, "--spare-nodes 100001: must be between 0 and 100,000"),
        ({"enabled": False, "spare_nodes": 1}, "--spare-nodes needs the preflight"),
        ({"enabled": False, "strict": True}, "--preflight-strict with --no-preflight"),
    ],
)
def test_options_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        PreflightOptions(**kwargs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--spare-nodes", "1"], "--spare-nodes only apply with --slurm"),
        (["--no-preflight"], "--no-preflight only apply with --slurm"),
        (["--preflight-strict"], "--preflight-strict only apply with --slurm"),
        (["--slurm", "--spare-nodes", "-1"], "--spare-nodes -1: must be between 0 and 100,000"),
        (["--slurm", "--spare-nodes", "two"], "'--spare-nodes'"),
        (["--slurm", "--spare-nodes", "1", "--no-preflight"], "--spare-nodes needs the preflight"),
        (["--executor", "submitit", "--spare-nodes", "1"], "the submitit executor runs no preflight"),
    ],
)
def test_bad_flags_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.yaml").write_text(minimal_plan_yaml(nodes=1, nproc=1))
    result = CliRunner().invoke(app, ["launch", "plan.yaml", "--dry-run", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("llmctl: error: ") and message in lines[0], result.output
    assert not (tmp_path / "llmctl-jobs").exists()


def test_dry_run_asks_for_the_spares_and_runs_the_preflight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.yaml").write_text(minimal_plan_yaml(nodes=2, nproc=1))
    out = CliRunner().invoke(app, ["launch", "plan.yaml", "--slurm", "--spare-nodes", "1", "--dry-run"]).output
    assert "#SBATCH --nodes=3\n" in out and "export LLMCTL_NNODES=2\n" in out
    assert '"$LLMCTL_PYTHON" -m llmctl.launch.preflight) || {\n' in out
    out = CliRunner().invoke(app, ["launch", "plan.yaml", "--slurm", "--preflight-strict", "--dry-run"]).output
    assert "-m llmctl.launch.preflight --strict)" in out
    out = CliRunner().invoke(app, ["launch", "plan.yaml", "--slurm", "--no-preflight", "--dry-run"]).output
    assert "llmctl.launch.preflight" not in out and "train_nodes=$SLURM_JOB_NODELIST" in out


def test_status_shows_the_last_preflight_line(tmp_path: Path) -> None:
    record = jobs.JobRecord("7", "sbatch", str(tmp_path), "tiny", 2, 1, "2026-11-25T00:00:00Z", spare_nodes=1)
    assert jobs.preflight_note(record) == ""
    (tmp_path / "events").write_text(
        "preflight ok 2026-11-25T00:00:05Z restart 0: training on node1,node3; dropped node2 (failed: boom)\n"
        "requeued 2026-11-25T00:09:00Z restart 0\n"
        "preflight failed 2026-11-25T00:12:00Z restart 1: node3 failed: boom; 1 of 3 nodes left, the plan needs 2\n"
        "exit 1 2026-11-25T00:12:01Z restart 1\n"
    )
    assert jobs.preflight_note(record) == "failed: node3 failed: boom; 1 of 3 nodes left, the plan needs 2"
    assert jobs.folder_state(record) == "FAILED (exit 1)"


# ---------------------------------------------------------------------------------------------- agents


def test_cross_step_torchrun_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs, "node_addr", lambda node: {"node1": "10.0.0.1", "node3": "10.0.0.3"}[node])
    env = {"SLURMD_NODENAME": "node3", "LLMCTL_TORCHRUN": "/v/bin/torchrun", "LLMCTL_PREFLIGHT_NPROC": "4"}
    env |= {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"}
    worker = ["--out", "/j/preflight/42.1", "--expect-gpus", "4"]
    rdzv = ["--nnodes", "2", "--rdzv-node", "node1", "--rdzv-endpoint", "10.0.0.1:31541", "--join-timeout-s", "300"]
    assert node.cross_command([*rdzv, "--", *worker], env) == [
        "/v/bin/torchrun",
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        "--rdzv_id=preflight-42-1",
        "--rdzv_endpoint=10.0.0.1:31541",
        "--rdzv_conf=is_host=0,join_timeout=300",
        "--local_addr=10.0.0.3",
        "--max_restarts=0",
        "--module",
        "llmctl.netbench.quick",
        "cross",
        *worker,
    ]
    assert "--rdzv_conf=is_host=1,join_timeout=300" in node.cross_command(
        [*rdzv, "--", *worker], {**env, "SLURMD_NODENAME": "node1"}
    )


def test_node_step_ranks_get_torchruns_variables() -> None:
    env = node.rank_env({"PATH": "/bin"}, 4, 3, 29999)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "3",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "0",
    }
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["OMP_NUM_THREADS"]) == ("127.0.0.1", "29999", "1")
    assert "OMP_NUM_THREADS" not in node.rank_env({}, 1, 0, 1)
    # torchrun's rule: one thread per rank as soon as a node runs more than one (two included); the user's kept
    assert node.rank_env({}, 2, 1, 1)["OMP_NUM_THREADS"] == "1"
    assert node.rank_env({"OMP_NUM_THREADS": "6"}, 2, 1, 1)["OMP_NUM_THREADS"] == "6"


def test_node_step_stops_the_other_ranks_when_one_fails(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Rank 1 fails at once, rank 0 would sleep for a minute: the agent stops it and returns rank 1's code."""
    import sys
    import time

    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n")
    real_popen = node.subprocess.Popen
    monkeypatch.setattr(node.subprocess, "Popen", lambda argv, env: real_popen([sys.executable, str(script)], env=env))
    t0 = time.monotonic()
    assert node.run_node_ranks([], {"LLMCTL_PREFLIGHT_NPROC": "2", "PATH": "/usr/bin:/bin"}) == 3
    assert time.monotonic() - t0 < 20


def test_outside_a_job_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMCTL_JOB_DIR", raising=False)
    assert preflight_main([]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.startswith("llmctl: error: not inside an llmctl sbatch job (LLMCTL_JOB_DIR")


# ---------------------------------------------------------------------------------------------- requeue elsewhere


def failed_node2() -> pf.Decision:
    checks = {"node1": ok("node1"), "node2": pf.NodeCheck(node="node2", ok=False, error="boom")}
    return pf.decide(NODES[:2], 2, checks)


@pytest.mark.parametrize(
    ("job", "usable", "restart", "expected"),
    [
        ({}, NODES, 0, (["node2"], "2 usable node(s) left in the partition")),
        (
            {"ExcNodeList": "node9"},
            [*NODES, "node4"],
            1,
            (["node2", "node9"], "3 usable node(s) left in the partition"),
        ),
        ({}, NODES[:2], 0, (None, "the partition has 1 other usable node(s), the job needs 2")),
        ({"ReqNodeList": "node1,node2"}, NODES, 0, (None, "the job asks for node2 by name (--nodelist)")),
        ({}, NODES, 20, (None, "requeued 20 times already (the limit)")),
    ],
    ids=["spare-in-partition", "keeps-earlier-excludes", "too-few-left", "pinned-nodes", "limit"],
)
def test_requeue_without_the_failed_nodes_when_the_partition_allows(job, usable, restart, expected) -> None:
    assert requeue.requeue_without(failed_node2(), job, usable, restart, 20) == expected


def test_a_passing_preflight_or_a_cross_step_failure_is_never_requeued() -> None:
    assert requeue.requeue_without(pf.decide(NODES[:2], 2, {n: ok(n) for n in NODES[:2]}), {}, NODES, 0, 20)[0] is None
    d = pf.decide(NODES[:2], 2, {n: ok(n) for n in NODES[:2]}, cross_error="rank 1 never joined")
    assert d.exclude == [] and requeue.requeue_without(d, {}, NODES, 0, 20) == (None, "nothing to leave out")
