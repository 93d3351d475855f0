"""The preflight's batch-host half without SLURM: what the job's environment gives it (`JobContext`), the srun steps
`host.run` starts and what it records after each, and the exit codes `main` gives the job script. The srun steps
are stubs here (the real jobs are tests/launch/test_preflight_slurm.py, minutes); these hold each value on the way,
so that a slip in one of them shows without a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_helpers import job_env, minimal_plan_yaml

from llmctl.launch import jobs
from llmctl.launch.preflight import decision as pf
from llmctl.launch.preflight import host
from llmctl.launch.preflight import main as preflight_main
from llmctl.launch.preflight.job import JobContext
from llmctl.netbench.quick_files import node_result_path


def test_the_job_context_reads_the_scripts_exports(tmp_path: Path) -> None:
    ctx = JobContext.from_env(job_env(tmp_path))
    assert (ctx.job_dir, ctx.plan_path, ctx.job_id, ctx.nodelist) == (
        tmp_path,
        tmp_path / "plan.yaml",
        "42",
        "node[1-2]",
    )
    # The cross step's rendezvous: 2000 above the training's (whose ports span 2000), never another job's.
    assert ctx.rdzv_port == 29542 + 2000
    # A first run has no SLURM_RESTART_COUNT (and some sites export it empty): restart "0" either way.
    assert ctx.restart == "0"
    assert JobContext.from_env(job_env(tmp_path, SLURM_RESTART_COUNT="")).restart == "0"
    assert JobContext.from_env(job_env(tmp_path, SLURM_RESTART_COUNT="3")).restart == "3"


class FakeSteps:
    """`host._run_step` and `host._cross` stubbed: each node step's argv is kept and every node passes its check;
    the cross step's nodes are kept."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: list[list[str]] = []
        self.cross: list[list[str]] = []

    def run_step(self, argv: list[str], timeout_s: float, env: dict[str, str]) -> int:
        self.steps.append(argv)
        nodes = next(a for a in argv if a.startswith("--nodelist=")).split("=", 1)[1].split(",")
        for n in nodes:
            check = {"node": n, "ok": True, "device": "cpu", "ranks": 2, "seconds": 0.1}
            node_result_path(self.out, n).write_text(json.dumps(check))
        return 0

    def run_cross(self, ctx, out, nodes, timeout_s, agent, worker_args, env):  # noqa: ANN001, ANN201
        self.cross.append(list(nodes))
        return None, None


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_batch_host_runs_the_node_step_then_the_cross_step_on_two_or_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: int
) -> None:
    names = [f"node{i + 1}" for i in range(nodes)]
    (tmp_path / "plan.yaml").write_text(minimal_plan_yaml(nodes=nodes, nproc=2))
    fake = FakeSteps(tmp_path / "preflight" / "42.0")
    monkeypatch.setattr(jobs, "hostnames", lambda nodelist: names)
    monkeypatch.setattr(host, "_run_step", fake.run_step)
    monkeypatch.setattr(host, "_cross", fake.run_cross)

    d = host.run(env=job_env(tmp_path))

    # One node step on every allocated node, each node's answer its own: one failure must not kill the others.
    [step] = fake.steps
    assert step[:6] == [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(names)}",
        "--kill-on-bad-exit=0",
    ]
    assert step[step.index("agent") + 1] == "node"
    # The cross step (a torchrun rendezvous and bench-net's all-reduce) needs two nodes: none with one.
    assert fake.cross == ([names] if nodes > 1 else [])
    assert d.ok and d.train == names
    result = json.loads((tmp_path / "preflight" / "42.0" / "result.json").read_text())
    assert result["train"] == names and set(result["step_seconds"]) == ({"node", "cross"} if nodes > 1 else {"node"})
    [line] = (tmp_path / "events").read_text().splitlines()
    assert line.startswith("preflight ok ") and line.endswith(f" restart 0: training on {','.join(names)}")


def test_main_gives_the_script_the_nodes_or_the_exit_code_that_stops_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    asked: list[bool] = []
    decisions = {
        "ok": pf.Decision(allocated=["node1", "node2"], needed=1, train=["node2"]),
        "failed": pf.Decision(allocated=["node1"], needed=1, failure="node1 failed: boom", exclude=["node1"]),
    }
    for k, v in job_env(tmp_path).items():
        monkeypatch.setenv(k, v)

    def run(strict: bool = False) -> pf.Decision:
        asked.append(strict)
        return decisions["failed" if strict else "ok"]

    monkeypatch.setattr(preflight_main, "run", run)
    monkeypatch.setattr(preflight_main, "requeue", lambda ctx, d, env: False)
    assert preflight_main.main([]) == 0 and asked == [False]
    assert capsys.readouterr().out == "node2\n"  # stdout: the nodes to train on, nothing else
    assert preflight_main.main(["--strict"]) == 1 and asked == [False, True]
    assert capsys.readouterr().out == ""  # a stop trains on nothing
    monkeypatch.setattr(preflight_main, "requeue", lambda ctx, d, env: ctx.job_id == "42" and d.exclude == ["node1"])
    assert preflight_main.main(["--strict"]) == 3  # requeued without node1: the script exits 0
