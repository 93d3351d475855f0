"""The preflight: a check of every allocated node before training, the first thing an sbatch job does
(templates/slurm.sbatch.j2) unless `llmctl launch --no-preflight`. Torch-free; the torch half is
llmctl.netbench.quick, which torchrun starts on the nodes.

What runs where, in one job:
1. On the batch host, `python -m llmctl.launch.preflight` (`main`): lists the allocated nodes, runs two srun steps,
   decides, logs, appends to the job's events file and prints the nodes to train on (stdout: the only thing it
   prints there; the script reads it). Exit 1 (one line on stderr) when the job must stop.
2. The node step, on every node at once, each alone: `srun` -> `python -m llmctl.launch.preflight agent node`, which
   starts the node's ranks as torchrun would (`run_node_ranks`) -> `python -m llmctl.netbench.quick node`: the
   devices are there (the plan's GPU count, each with the memory the plan predicts; on a CPU the ranks start), an
   all-reduce among the node's ranks.
3. The cross step, on the nodes that passed, together: `agent cross` execs torchrun with a c10d rendezvous as the
   training uses (`cross_command`), running bench-net's worker in quick mode: the all-reduce over all of them and a few pairwise rounds. bench-net's rules
   (`llmctl.netbench.report.judge_nodes`, needs 3 nodes or more) name slow nodes and links.
4. Back on the batch host (`decide`): failed and slow nodes are dropped, then, while more nodes remain than the plan
   needs (`--spare-nodes N` asked SLURM for N more), the worst of the rest. Too few left: the job stops, naming the
   nodes. Bandwidth well below what the plan assumed is a warning with the figures (a stop with --preflight-strict).

Files, under <job folder>/preflight/<job id>.<restart>/: node-<name>.json and node-<name>.errors.jsonl (step 2),
bench.json and cross.errors.jsonl (step 3), result.json (step 4). The events file gets one `preflight ok|warning|
failed <time> restart R: ...` line each (`llmctl status` shows the last).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.bounds import LIMITS
from llmctl.errors import ERROR_FILE_ENV, InputError, RuntimeFailure, one_line, read_reports
from llmctl.errors import report as report_error

if TYPE_CHECKING:
    from llmctl.netbench.report import BenchReport
    from llmctl.spec.planfile import Plan

SLOW_FRACTION = 0.7
"""bench-net's --slow-fraction default: a node, link or figure below 0.7 x its reference is slow."""
TIMEOUT_ENV = "LLMCTL_PREFLIGHT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
"""Per step: torch's import and the process groups on every node (a cold start on a shared file system with many
nodes importing at once can take minutes). A node that has not answered by then has failed."""
COLLECTIVE_TIMEOUT_S = 60.0
"""The quick collectives' own timeout (and bench-net's check-in wait): a healthy link moves 64 MiB in well under
a second."""
PORT_OFFSET = 2000
"""The cross step's rendezvous port is the training's plus this: the training ports span 2000 (the template
derives them from the job id), so a preflight never takes another job's training port."""


@dataclass(frozen=True)
class PreflightOptions:
    """`llmctl launch --slurm` options for the preflight (the sbatch executor runs it)."""

    enabled: bool = True
    """--no-preflight turns it off."""
    strict: bool = False
    """--preflight-strict: bandwidth well below the plan's assumption stops the job instead of warning."""
    spare_nodes: int = 0
    """--spare-nodes N: ask SLURM for N more nodes than the plan needs; the preflight drops the worst N."""

    def __post_init__(self) -> None:
        if not 0 <= self.spare_nodes <= LIMITS["--nodes"]:
            raise InputError(f"--spare-nodes {self.spare_nodes}: must be between 0 and {int(LIMITS['--nodes']):,}")
        if not self.enabled and self.spare_nodes:
            raise InputError(
                "--spare-nodes needs the preflight (it picks which nodes to leave out)", hint="drop --no-preflight"
            )
        if not self.enabled and self.strict:
            raise InputError("--preflight-strict with --no-preflight: give one")

    @property
    def given(self) -> list[str]:
        """The flags given a non-default value (for "only apply with ...")."""
        return [
            flag
            for flag, on in (
                ("--no-preflight", not self.enabled),
                ("--preflight-strict", self.strict),
                ("--spare-nodes", bool(self.spare_nodes)),
            )
            if on
        ]


# ---------------------------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class NodeCheck:
    """One node's result of the node step (what llmctl.netbench.quick writes), or why there is none."""

    node: str
    ok: bool
    error: str | None = None
    device: str | None = None
    ranks: int | None = None
    intra_busbw_gbytes_s: float | None = None
    """The all-reduce among the node's ranks (None with one rank per node)."""
    seconds: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeCheck:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Assumed:
    """What the plan assumed that the preflight can measure (None: the plan does not say)."""

    intra_busbw_gbytes_s: float | None = None
    """Bus bandwidth per GPU inside a node, GB/s."""
    inter_node_busbw_gbytes_s: float | None = None
    """Bus bandwidth per node across nodes (all its NICs together), GB/s."""


def plan_assumptions(plan: Plan) -> Assumed:
    """The bandwidth the plan's prediction used (`predicted.intra_node_busbw_gbytes_s` and
    `inter_node_busbw_gbytes_s`, written by `llmctl plan`). A hand-written plan without them: only the node checks
    and the slow-node rules apply."""
    p = plan.predicted
    return Assumed(
        intra_busbw_gbytes_s=p.intra_node_busbw_gbytes_s,
        inter_node_busbw_gbytes_s=p.inter_node_busbw_gbytes_s,
    )


@dataclass
class Decision:
    allocated: list[str]
    needed: int
    train: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    """node -> why, in the order they were dropped."""
    warnings: list[str] = field(default_factory=list)
    failure: str | None = None
    """One line: why the job stops (None: it trains on `train`)."""
    exclude: list[str] = field(default_factory=list)
    """The failed or slow nodes that left too few: a requeue without them may run (`requeue_without`)."""
    measured: dict[str, float] = field(default_factory=dict)
    """The figures compared with the plan (GB/s)."""
    assumed: Assumed = field(default_factory=lambda: Assumed())
    """What they were compared with."""

    @property
    def ok(self) -> bool:
        return self.failure is None


def _gbps(gbytes_s: float) -> str:
    return f"{gbytes_s:.3g} GB/s ({gbytes_s * 8:.3g} Gbit/s)"


def _names(nodes: list[str]) -> str:
    return ",".join(nodes)


def _node_score(node: str, checks: dict[str, NodeCheck], bench: BenchReport | None) -> tuple[float, float]:
    """Higher is better: the node's best pairwise link, then its intra-node all-reduce (inf when unmeasured, so
    that an unmeasured figure never makes a node look worst)."""
    link = intra = float("inf")
    if bench is not None:
        v = next((v for v in bench.node_verdicts if v.name == node), None)
        if v is not None and v.best_link_busbw_gbytes_s is not None:
            link = v.best_link_busbw_gbytes_s
    c = checks.get(node)
    if c is not None and c.intra_busbw_gbytes_s is not None:
        intra = c.intra_busbw_gbytes_s
    return link, intra


def decide(
    allocated: list[str],
    needed: int,
    checks: dict[str, NodeCheck],
    bench: BenchReport | None = None,
    cross_error: str | None = None,
    assumed: Assumed = Assumed(),
    strict: bool = False,
    fraction: float = SLOW_FRACTION,
) -> Decision:
    """Which nodes train, from the node checks and the quick bench across the nodes that passed. Pure."""
    from llmctl.netbench.report import below_median

    d = Decision(allocated=list(allocated), needed=needed, assumed=assumed)
    spares = len(allocated) - needed
    for n in allocated:
        c = checks.get(n)
        if c is None or not c.ok:
            d.dropped[n] = f"failed: {c.error if c is not None and c.error else 'no answer'}"
    failed = list(d.dropped)
    healthy = [n for n in allocated if n not in d.dropped]

    def stop(why: str, nodes: list[str]) -> Decision:
        fix = f"relaunch with {_names(nodes)} in --exclude"
        if spares < len(nodes):
            fix += f", or with --spare-nodes {len(nodes)}"
        left = len(allocated) - len(d.dropped)
        d.failure = f"{why}; {left} of {len(allocated)} nodes left, the plan needs {needed} ({fix})"
        d.exclude = list(nodes)
        return d

    if len(healthy) < needed:
        return stop("; ".join(f"{n} {d.dropped[n]}" for n in failed), failed)
    if cross_error is not None:
        d.failure = f"the all-reduce across {_names(healthy)} failed: {cross_error}"
        return d

    # Slow by bench-net's rules: its verdicts across nodes (best pairwise link, intra-node inside the bench), and
    # the same median rule on the node step's intra-node all-reduce (measured on every node at the same time).
    slow: dict[str, str] = {}
    if bench is not None:
        slow.update({v.name: v.reason or "slow" for v in bench.node_verdicts if v.slow and v.name in healthy})
    intra = {n: checks[n].intra_busbw_gbytes_s for n in healthy if checks[n].intra_busbw_gbytes_s is not None}
    if intra:
        med = statistics.median(intra.values())
        for n in below_median(intra, fraction):  # type: ignore[arg-type]
            why = f"intra-node all-reduce {intra[n]:.3g} GB/s < {fraction:g} x median {med:.3g} GB/s"
            slow[n] = f"{slow[n]}; {why}" if n in slow else why
    for n in healthy:
        if n in slow:
            d.dropped[n] = f"slow: {slow[n]}"
    keep = [n for n in healthy if n not in slow]
    if len(keep) < needed:
        named = [n for n in healthy if n in slow]
        return stop("; ".join(f"{n} {d.dropped[n]}" for n in failed + named), failed + named)

    # More than needed (spares): leave out the worst, the latest in the allocation on a tie.
    while len(keep) > needed:
        worst = min(reversed(keep), key=lambda n: _node_score(n, checks, bench))
        link, intra_bw = _node_score(worst, checks, bench)
        measured = [f"best link {link:.3g} GB/s"] if link != float("inf") else []
        measured += [f"intra-node {intra_bw:.3g} GB/s"] if intra_bw != float("inf") else []
        d.dropped[worst] = "spare, the worst of the rest" + (f": {', '.join(measured)}" if measured else "")
        keep.remove(worst)
    d.train = keep

    # Bandwidth against the plan's assumption (per GPU inside a node, per node across nodes).
    below = []
    if intra:
        got = statistics.median(intra[n] for n in keep if n in intra) if any(n in intra for n in keep) else None
        if got is not None:
            d.measured["intra_busbw_gbytes_s"] = got
            if assumed.intra_busbw_gbytes_s and got < fraction * assumed.intra_busbw_gbytes_s:
                below.append(
                    f"intra-node all-reduce busbw {_gbps(got)} per GPU, {got / assumed.intra_busbw_gbytes_s:.2f} x "
                    f"the plan's {_gbps(assumed.intra_busbw_gbytes_s)}"
                )
    if bench is not None and len(bench.nodes) > 1:
        got = bench.inter_node_busbw_gbytes_s(bench.config.sizes_bytes[0], per_node=True)
        if got is not None:
            d.measured["inter_node_busbw_gbytes_s"] = got
            if assumed.inter_node_busbw_gbytes_s and got < fraction * assumed.inter_node_busbw_gbytes_s:
                below.append(
                    f"inter-node all-reduce busbw {_gbps(got)} per node, "
                    f"{got / assumed.inter_node_busbw_gbytes_s:.2f} x the plan's {_gbps(assumed.inter_node_busbw_gbytes_s)}"
                )
    if below and strict:
        d.failure = "; ".join(below) + " (--preflight-strict; the plan's prediction will not hold)"
    else:
        d.warnings += [f"{b}: the run will be slower than the plan predicts" for b in below]
    return d


def summary(d: Decision) -> str:
    """The events-file line (without the keyword, time and restart) for a job that goes on."""
    out = f"training on {_names(d.train)}"
    if d.dropped:
        out += "; dropped " + "; ".join(f"{n} ({why})" for n, why in d.dropped.items())
    return out


# ---------------------------------------------------------------------------------------------- running it


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _say(line: str) -> None:
    """A line in the job log (stderr: stdout carries the node list to the script)."""
    print(f"llmctl: preflight: {one_line(line)}", file=sys.stderr, flush=True)


def _event(job_dir: Path, kind: str, restart: str, text: str) -> None:
    with open(job_dir / "events", "a") as f:
        f.write(f"preflight {kind} {_now()} restart {restart}: {one_line(text)}\n")


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
        f"--nodelist={_names(nodes)}",
        # One node's failure must not kill the others' checks: each node's answer is what the step is for.
        "--kill-on-bad-exit=0",
        *args,
    ]


def _first_error(path: Path) -> str | None:
    reports = read_reports(path)
    return reports[0].message if reports else None


def node_result_path(out: Path, node: str) -> Path:
    """Where the node step's local rank 0 writes its node's NodeCheck (llmctl.netbench.quick)."""
    return out / f"node-{node}.json"


def _errors_path(out: Path, step: str, node: str) -> Path:
    """$LLMCTL_ERROR_FILE of a step's ranks: one per node for the node step, one for the cross step."""
    return out / (f"node-{node}.errors.jsonl" if step == "node" else "cross.errors.jsonl")


def _log_path(out: Path, step: str, node: str) -> Path:
    """The output of a node's torchrun in a step (its agent redirects it there)."""
    return out / f"{step}-{node}.log"


def _load_node(out: Path, node: str, exit_note: str) -> NodeCheck:
    path = node_result_path(out, node)
    if path.is_file():
        try:
            return NodeCheck.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass
    error = _first_error(_errors_path(out, "node", node)) or exit_note
    return NodeCheck(node=node, ok=False, error=error)


@dataclass(frozen=True)
class JobContext:
    """What the batch script exports (templates/slurm.sbatch.j2) and SLURM sets, read once."""

    job_dir: Path
    plan_path: Path
    job_id: str
    restart: str
    nodelist: str
    rdzv_port: int

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> JobContext:
        env = dict(os.environ) if env is None else env
        missing = [
            k
            for k in ("LLMCTL_JOB_DIR", "LLMCTL_PLAN", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "LLMCTL_RDZV_PORT")
            if not env.get(k)
        ]
        if missing:
            raise InputError(
                f"not inside an llmctl sbatch job ({', '.join(missing)} unset)",
                hint="the preflight runs from the script `llmctl launch --slurm` writes",
            )
        return cls(
            job_dir=Path(env["LLMCTL_JOB_DIR"]),
            plan_path=Path(env["LLMCTL_PLAN"]),
            job_id=env["SLURM_JOB_ID"],
            restart=env.get("SLURM_RESTART_COUNT", "0") or "0",
            nodelist=env["SLURM_JOB_NODELIST"],
            rdzv_port=int(env["LLMCTL_RDZV_PORT"]) + PORT_OFFSET,
        )


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
    for stale in [*out.glob("node-*"), *out.glob("cross.*"), out / "bench.json", out / "result.json"]:
        stale.unlink(missing_ok=True)  # a resubmission that got a reused job id must not read an old answer
    devices = f"{gpus} GPU(s)" if gpus else f"{nproc} CPU rank(s)"
    _say(
        f"checking {len(allocated)} node(s) ({_names(allocated)}) for {needed} needed, {devices} each; results in {out}"
    )

    worker_args = ["--out", str(out), "--expect-gpus", str(gpus), "--timeout-s", str(COLLECTIVE_TIMEOUT_S)]
    if gpus and plan.predicted.memory_per_gpu_bytes:
        worker_args += ["--min-gpu-memory-bytes", str(plan.predicted.memory_per_gpu_bytes)]
    agent = [sys.executable, "-m", "llmctl.launch.preflight", "agent"]
    step_env = {**env, "LLMCTL_PREFLIGHT_NPROC": str(nproc)}
    t_step = time.monotonic()
    code = _run_step([*_srun(allocated, *agent, "node", "--", *worker_args)], timeout_s, step_env)
    steps = {"node": time.monotonic() - t_step}
    note = f"no answer within {timeout_s:g} s" if code is None else f"its node step exited with code {code}"
    checks = {n: _load_node(out, n, note) for n in allocated}
    for n in allocated:
        c = checks[n]
        if c.ok:
            bw = f", intra-node all-reduce {_gbps(c.intra_busbw_gbytes_s)}" if c.intra_busbw_gbytes_s else ""
            _say(f"{n}: ok ({c.ranks} rank(s) on {c.device}{bw})")
        else:
            _say(f"{n}: FAILED: {c.error} (log: {_log_path(out, 'node', n)})")

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
    from llmctl.netbench.report import load_bench

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
    bench_path = out / "bench.json"
    if code == 0 and bench_path.is_file():
        bench = load_bench(bench_path)
        world = bench.result("world")
        if world is not None:
            bw = world.points[-1].busbw_gbytes_s
            _say(f"all-reduce across {len(nodes)} nodes: busbw {_gbps(bw)} at {world.points[-1].size_bytes >> 20} MiB")
        for lk in bench.links:
            _say(f"pair {lk.a}-{lk.b}: busbw {_gbps(lk.busbw_gbytes_s)}{' (slow)' if lk.slow else ''}")
        return bench, None
    error = _first_error(_errors_path(out, "cross", ""))
    if error is None:
        error = f"no answer within {timeout_s:g} s" if code is None else f"the step exited with code {code}"
    return None, f"{error} (logs: {out}/cross-*.log)"


def _record(
    ctx: JobContext, out: Path, d: Decision, bench: BenchReport | None, seconds: float, steps: dict[str, float]
) -> None:
    result = {
        **asdict(d),
        "seconds": round(seconds, 3),
        "step_seconds": {k: round(v, 3) for k, v in steps.items()},
        "bench": str(out / "bench.json") if bench else None,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    for w in d.warnings:
        _say(f"warning: {w}")
        _event(ctx.job_dir, "warning", ctx.restart, w)
    if d.failure is not None:
        _event(ctx.job_dir, "failed", ctx.restart, d.failure)
        print(f"llmctl: preflight failed: {one_line(d.failure)}", file=sys.stderr, flush=True)
        return
    if d.measured and d.assumed == Assumed():
        _say("bandwidth not compared: the plan records none")
    _event(ctx.job_dir, "ok", ctx.restart, summary(d))
    took = ", ".join(f"{k} step {v:.1f} s" for k, v in steps.items())
    _say(f"{summary(d)} (took {seconds:.1f} s: {took})")


# ---------------------------------------------------------------------------------------------- requeue elsewhere
REQUEUED_EXIT = 3
"""The preflight's exit code when it has requeued the job without the nodes that failed (the script then exits 0)."""
_UNUSABLE = ("down", "drain", "drng", "fail", "maint", "unk", "inval", "futr", "plnd", "npc", "boot", "powered")
"""sinfo %t node states (prefixes) a requeued job cannot count on."""


def _job_fields(job_id: str) -> dict[str, str]:
    from llmctl.launch.jobs import query

    out = query(["scontrol", "show", "job", job_id]) or ""
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _names_of(nodelist: str | None) -> list[str]:
    from llmctl.launch.jobs import hostnames

    if not nodelist or nodelist == "(null)":
        return []
    try:
        return hostnames(nodelist)
    except RuntimeFailure:
        return []


def requeue_without(
    d: Decision, job: dict[str, str], usable: list[str], restart: int, max_requeues: int
) -> tuple[list[str] | None, str]:
    """Whether the job can run again without the nodes `d` excludes: (its new exclude list, why) or (None, why not).
    `job`: `scontrol show job` fields (ReqNodeList and ExcNodeList expanded to names); `usable`: the partition's nodes
    in a state a job can get. Pure."""
    if not d.exclude:
        return None, "nothing to leave out"
    if restart >= max_requeues:
        return None, f"requeued {restart} times already (the limit)"
    asked = set(job.get("ReqNodeList", "").split(",")) - {""}
    if asked & set(d.exclude):
        return None, f"the job asks for {_names(sorted(asked & set(d.exclude)))} by name (--nodelist)"
    exclude = sorted(set(job.get("ExcNodeList", "").split(",")) - {""} | set(d.exclude))
    others = [n for n in usable if n not in exclude]
    if len(others) < len(d.allocated):
        return None, f"the partition has {len(others)} other usable node(s), the job needs {len(d.allocated)}"
    return exclude, f"{len(others)} usable node(s) left in the partition"


def _requeue(ctx: JobContext, d: Decision, env: dict[str, str]) -> bool:
    """Requeue this job without `d.exclude` when the partition has the nodes for it; False (with the reason in the
    log) when it cannot. The requeue's kill (SIGTERM) is ignored until the exclude list is set on the pending job
    (SLURM changes a job's ExcNodeList only while it is pending)."""
    import signal
    import subprocess

    from llmctl.launch.jobs import query

    job = _job_fields(ctx.job_id)
    for key in ("ReqNodeList", "ExcNodeList"):
        job[key] = ",".join(_names_of(job.get(key)))
    part = job.get("Partition") or env.get("SLURM_JOB_PARTITION") or ""
    listing = query(["sinfo", "-h", "-N", "-p", part, "-o", "%N %t"]) if part else None
    rows = [ln.split() for ln in (listing or "").splitlines()]
    usable = sorted({r[0] for r in rows if len(r) == 2 and not r[1].rstrip("*~#!%$@^-").startswith(_UNUSABLE)})
    try:
        limit = int(env.get("LLMCTL_MAX_REQUEUES") or 0)
    except ValueError:
        limit = 0
    exclude, why = requeue_without(d, job, usable, int(ctx.restart or 0), limit)
    if exclude is None:
        _say(f"not requeued: {why}")
        return False
    # From here until this process exits: the requeue kills this run (SIGTERM), which must neither stop the update
    # below nor turn the preflight's exit code into 143 (the script would record the run as failed).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = subprocess.run(["scontrol", "requeue", ctx.job_id], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        signal.signal(signal.SIGTERM, previous)
        _say(f"not requeued: scontrol requeue failed: {one_line(out.stderr.strip() or '?')}")
        return False
    with open(ctx.job_dir / "events", "a") as f:
        f.write(f"requeued {_now()} restart {ctx.restart} without {','.join(exclude)}\n")
    for _ in range(40):  # pending within a moment of the requeue
        upd = subprocess.run(
            ["scontrol", "update", f"JobId={ctx.job_id}", f"ExcNodeList={','.join(exclude)}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if upd.returncode == 0:
            _say(f"requeued job {ctx.job_id} without {','.join(exclude)} ({why})")
            return True
        time.sleep(0.25)
    _say(f"requeued job {ctx.job_id}, but SLURM kept its nodes open: {one_line(upd.stderr.strip() or '?')}")
    return True


# ---------------------------------------------------------------------------------------------- on each node


def cross_command(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    """On one node, inside the cross step: the torchrun command for this node (exec'd by `main`), from
    `--nnodes N --rdzv-node NODE --rdzv-endpoint ADDR:PORT --join-timeout-s S [-- worker args]`: the rendezvous the
    training uses, hosted by the named node, every agent bound to its node's address (fake nodes may share a host)."""
    from llmctl.launch.jobs import node_addr
    from llmctl.launch.local import torchrun_command

    env = dict(os.environ) if env is None else env
    sep = argv.index("--") if "--" in argv else len(argv)
    opts, worker_args = dict(zip(argv[:sep:2], argv[1:sep:2])), argv[sep + 1 :]
    node = env.get("SLURMD_NODENAME") or ""
    addr = node_addr(node)
    if addr is None:
        raise RuntimeFailure(f"scontrol knows no address for this node ({node!r})")
    torchrun = [env["LLMCTL_TORCHRUN"]] if env.get("LLMCTL_TORCHRUN") else torchrun_command()
    return [
        *torchrun,
        f"--nnodes={opts['--nnodes']}",
        f"--nproc_per_node={env.get('LLMCTL_PREFLIGHT_NPROC', '1')}",
        "--rdzv_backend=c10d",
        f"--rdzv_id=preflight-{env.get('SLURM_JOB_ID', '0')}-{env.get('SLURM_RESTART_COUNT', '0')}",
        f"--rdzv_endpoint={opts['--rdzv-endpoint']}",
        f"--rdzv_conf=is_host={int(node == opts['--rdzv-node'])},join_timeout={opts['--join-timeout-s']}",
        f"--local_addr={addr}",
        "--max_restarts=0",
        "--module",
        "llmctl.netbench.quick",
        "cross",
        *worker_args,
    ]


def rank_env(env: dict[str, str], nproc: int, rank: int, port: int) -> dict[str, str]:
    """What torchrun --standalone gives local rank `rank` of `nproc` on one node (the variables
    llmctl.netbench.options.dist_env and torch's env:// initialization read)."""
    out = {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if nproc > 1:
        out.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default: K ranks do not each take every core
    return out


def run_node_ranks(worker_args: list[str], env: dict[str, str] | None = None) -> int:
    """On one node, inside the node step: start the node's ranks as torchrun would (`rank_env`), wait for them, and
    stop the others when one fails (torchrun's --max_restarts=0). Not torchrun itself: its agent imports torch too,
    which is half the step on a busy node; torchrun runs in the cross step and in training."""
    import signal
    import socket

    env = dict(os.environ) if env is None else env
    nproc = int(env.get("LLMCTL_PREFLIGHT_NPROC", "1"))
    with socket.socket() as sock:  # a free port for rank 0's store (loopback: the ranks share this node)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, "-m", "llmctl.netbench.quick", "node", *worker_args]
    procs = [subprocess.Popen(argv, env=rank_env(env, nproc, r, port)) for r in range(nproc)]

    def stop(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    previous = signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))  # srun's, at the step timeout
    first = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and not first:
                first = failed[0]
                stop()
            if all(c is not None for c in codes):
                return first or next((c for c in codes if c), 0)
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["agent"]:
            node = os.environ.get("SLURMD_NODENAME") or ""
            out = Path(args[args.index("--out") + 1]) if "--out" in args else Path(".")
            os.environ["LLMCTL_NODE_NAME"] = node  # bench-net names nodes by it (fake nodes share one hostname)
            step = args[1] if len(args) > 1 else ""
            if step not in ("node", "cross"):
                raise InputError(f"agent step {step!r}: expected node or cross")
            os.environ[ERROR_FILE_ENV] = str(_errors_path(out, step, node))
            # The ranks' and torchrun's own output (warnings, a failed rank's report) goes to a file per node and
            # step; the job log gets the preflight's summary lines, which name that file when something failed.
            log = os.open(_log_path(out, step, node), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            rest = args[2:]
            if step == "node":
                return run_node_ranks(rest[rest.index("--") + 1 :] if "--" in rest else rest)
            command = cross_command(rest)
            os.execvp(command[0], command)
        unknown = [a for a in args if a != "--strict"]
        if unknown:
            raise InputError(
                f"unexpected arguments {unknown}", hint="usage: python -m llmctl.launch.preflight [--strict]"
            )
        d = run(strict="--strict" in args)
        if not d.ok and d.exclude and _requeue(JobContext.from_env(), d, dict(os.environ)):
            return REQUEUED_EXIT
    except Exception as e:  # LlmctlError, or a bug: one line in the job log, and the job stops rather than trains blind
        return report_error(e)
    if not d.ok:
        return 1
    print(_names(d.train), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
