"""The preflight on the batch host (`run`): the node step on every allocated node, the cross step on those that
passed, the decision (llmctl.launch.preflight.decision), recorded in result.json, the job log and the events file."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from llmctl.errors import InputError, one_line
from llmctl.launch.preflight.decision import (
    Assumed,
    Decision,
    NodeCheck,
    decide,
    gbps,
    nodelist,
    plan_assumptions,
    summary,
)
from llmctl.launch.preflight.job import JobContext, event, log_path, say, step_errors
from llmctl.netbench.quick_files import bench_path, node_result_path

if TYPE_CHECKING:
    from llmctl.spec.bench import BenchReport

TIMEOUT_ENV = "LLMCTL_PREFLIGHT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
"""Per step: torch's import and the process groups on every node (a cold start on a shared file system with many
nodes importing at once can take minutes). A node that has not answered by then has failed."""
COLLECTIVE_TIMEOUT_S = 60.0
"""The quick collectives' own timeout (and bench-net's check-in wait): a healthy link moves 64 MiB in well under
a second."""


def _run_step(argv: list[str], timeout_s: float, env: dict[str, str]) -> int | None:
    """Run an srun step with its output in the job log; its exit code, or None when it ran out of time (then it
    is stopped: SIGTERM, which srun forwards to the tasks, then SIGKILL)."""
    proc = subprocess.Popen(argv, stdout=sys.stderr.fileno(), stderr=sys.stderr.fileno(), env=env)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def _srun(nodes: list[str], *args: str) -> list[str]:
    return [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={nodelist(nodes)}",
        # One node's failure must not kill the others' checks: each node's answer is what the step is for.
        "--kill-on-bad-exit=0",
        *args,
    ]


AGENT_ENV = "LLMCTL_PREFLIGHT_AGENT"
"""A container job's agent command (shell words: the step's container options, then a script that runs the --setup
lines and the container's `python -m llmctl.launch.preflight agent "$@"`), written by the job script
(llmctl.launch.slurm.preflight_agent_words)."""


def agent_command(env: dict[str, str]) -> list[str]:
    """What srun runs on each node before `node|cross ...`: this Python's agent, or a container job's (AGENT_ENV)."""
    words = env.get(AGENT_ENV, "")
    if words.strip():
        try:
            return shlex.split(words)
        except ValueError:
            raise InputError(f"{AGENT_ENV}: not a shell command line ({one_line(words)[:80]})") from None
    return [sys.executable, "-m", "llmctl.launch.preflight", "agent"]


def _load_node(out: Path, node: str, exit_note: str) -> NodeCheck:
    path = node_result_path(out, node)
    if path.is_file():
        try:
            return NodeCheck.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass
    first = step_errors(out, "node", node).first()
    error = first.message if first is not None else exit_note
    return NodeCheck(node=node, ok=False, error=error)


def run(strict: bool = False, env: dict[str, str] | None = None) -> Decision:
    """The whole preflight, on the batch host; returns the decision (already logged and recorded)."""
    from llmctl.launch.jobs import hostnames
    from llmctl.spec.planfile import load_plan

    t0 = time.monotonic()
    env = dict(os.environ) if env is None else env
    ctx = JobContext.from_env(env)
    plan = load_plan(ctx.plan_path)
    needed, nproc = plan.hardware.nodes, plan.hardware.nproc_per_node
    gpus = nproc if plan.hardware.gpu else 0
    try:
        timeout_s = float(env.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)
    except ValueError:
        raise InputError(f"{TIMEOUT_ENV}={env[TIMEOUT_ENV]!r}: expected seconds") from None
    allocated = hostnames(ctx.nodelist)
    out = ctx.job_dir / "preflight" / f"{ctx.job_id}.{ctx.restart}"
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("node-*"), *out.glob("cross.*"), bench_path(out), out / "result.json"]:
        stale.unlink(missing_ok=True)  # a resubmission that got a reused job id must not read an old answer
    devices = f"{gpus} GPU(s)" if gpus else f"{nproc} CPU rank(s)"
    say(
        f"checking {len(allocated)} node(s) ({nodelist(allocated)}) for {needed} needed, {devices} each; results in {out}"
    )

    worker_args = ["--out", str(out), "--expect-gpus", str(gpus), "--timeout-s", str(COLLECTIVE_TIMEOUT_S)]
    if gpus and plan.predicted.memory_per_gpu_bytes:
        worker_args += ["--min-gpu-memory-bytes", str(plan.predicted.memory_per_gpu_bytes)]
    agent = agent_command(env)
    step_env = {**env, "LLMCTL_PREFLIGHT_NPROC": str(nproc)}
    t_step = time.monotonic()
    code = _run_step([*_srun(allocated, *agent, "node", "--", *worker_args)], timeout_s, step_env)
    steps = {"node": time.monotonic() - t_step}
    note = f"no answer within {timeout_s:g} s" if code is None else f"its node step exited with code {code}"
    checks = {n: _load_node(out, n, note) for n in allocated}
    for n in allocated:
        c = checks[n]
        if c.ok:
            bw = f", intra-node all-reduce {gbps(c.intra_busbw_gbytes_s)}" if c.intra_busbw_gbytes_s else ""
            say(f"{n}: ok ({c.ranks} rank(s) on {c.device}{bw})")
        else:
            say(f"{n}: FAILED: {c.error} (log: {log_path(out, 'node', n)})")

    healthy = [n for n in allocated if checks[n].ok]
    bench, cross_error = None, None
    if len(healthy) >= max(2, needed):
        t_step = time.monotonic()
        bench, cross_error = _cross(ctx, out, healthy, timeout_s, agent, worker_args, step_env)
        steps["cross"] = time.monotonic() - t_step
    d = decide(allocated, needed, checks, bench, cross_error, plan_assumptions(plan), strict)
    _record(ctx, out, d, bench, time.monotonic() - t0, steps)
    return d


def _cross(
    ctx: JobContext,
    out: Path,
    nodes: list[str],
    timeout_s: float,
    agent: list[str],
    worker_args: list[str],
    env: dict[str, str],
) -> tuple[BenchReport | None, str | None]:
    from llmctl.launch.jobs import node_addr
    from llmctl.spec.bench import load_bench

    addr = node_addr(nodes[0])
    if addr is None:
        return None, f"scontrol knows no address for {nodes[0]}"
    rdzv = [
        "--nnodes",
        str(len(nodes)),
        "--rdzv-node",
        nodes[0],
        "--rdzv-endpoint",
        f"{addr}:{ctx.rdzv_port}",
        "--join-timeout-s",
        str(int(timeout_s)),
    ]
    code = _run_step(_srun(nodes, *agent, "cross", *rdzv, "--", *worker_args), timeout_s, env)
    if code == 0 and bench_path(out).is_file():
        bench = load_bench(bench_path(out))
        world = bench.result("world")
        if world is not None:
            bw = world.points[-1].busbw_gbytes_s
            say(f"all-reduce across {len(nodes)} nodes: busbw {gbps(bw)} at {world.points[-1].size_bytes >> 20} MiB")
        for lk in bench.links:
            say(f"pair {lk.a}-{lk.b}: busbw {gbps(lk.busbw_gbytes_s)}{' (slow)' if lk.slow else ''}")
        return bench, None
    first = step_errors(out, "cross", "").first()
    if first is not None:
        error = first.message
    else:
        error = f"no answer within {timeout_s:g} s" if code is None else f"the step exited with code {code}"
    return None, f"{error} (logs: {out}/cross-*.log)"


def _record(
    ctx: JobContext, out: Path, d: Decision, bench: BenchReport | None, seconds: float, steps: dict[str, float]
) -> None:
    result = {
        **asdict(d),
        "seconds": round(seconds, 3),
        "step_seconds": {k: round(v, 3) for k, v in steps.items()},
        "bench": str(bench_path(out)) if bench else None,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    for w in d.warnings:
        say(f"warning: {w}")
        event(ctx.job_dir, "warning", ctx.restart, w)
    if d.failure is not None:
        event(ctx.job_dir, "failed", ctx.restart, d.failure)
        print(f"llmctl: preflight failed: {one_line(d.failure)}", file=sys.stderr, flush=True)
        return
    if d.measured and d.assumed == Assumed():
        say("bandwidth not compared: the plan records none")
    event(ctx.job_dir, "ok", ctx.restart, summary(d))
    took = ", ".join(f"{k} step {v:.1f} s" for k, v in steps.items())
    say(f"{summary(d)} (took {seconds:.1f} s: {took})")
