"""How long `llmctl plan` takes, side by side with `python -c "import torch"` on the same machine in the same run.

The bounds (issue 48, "Speed"):
1. one plan under 0.5 s of CPU in-process (`llmctl.plan.planner.plan()`: enumeration, memory model, cost model,
   explanations) for every model in the catalog, on one node of 8 H100-SXM and on 1,024 nodes of them (a plan that
   answers "does not fit" is timed too: it is an answer);
2. the whole command (`llmctl plan ... --json --no-write` in a fresh interpreter, imports included: the child's CPU
   time, user + sys) under half of `import torch`'s CPU time in a fresh interpreter;
3. `llmctl plan MODEL --compare all --tokens 1T --json` (the whole GPU catalog) under 2 s of CPU, end to end;
4. torch is never imported by the planning commands.

CPU time, not wall time: the machine this was written on is shared (2 cores, several jobs), which inflates wall time
but not the CPU a process uses. Each in-process plan is the first of its model in this process (the planner's caches
are per model spec: nothing of an earlier plan of the same model is reused); the catalogs are loaded before timing.
Exits non-zero if a bound fails, with each figure and its ratio to its bound printed.

Run: .venv/bin/python benchmarks/plan_speed.py [--repeat 3] [--models llama-3.1-8b,deepseek-v3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llmctl.errors import DoesNotFitError  # noqa: E402
from llmctl.plan import comm as cm  # noqa: E402
from llmctl.plan import planner as pl  # noqa: E402
from llmctl.plan.request import PlanRequest  # noqa: E402
from llmctl.spec.hardware import resolve_gpu  # noqa: E402
from llmctl.spec.models import preset_names, resolve_model  # noqa: E402

PLAN_BOUND_S = 0.5  # issue 48: one plan in-process
COMMAND_BOUND = 0.5  # issue 48: the whole command, as a fraction of `import torch`
COMPARE_BOUND_S = 2.0  # issue 48: --compare all
GPU, GPUS_PER_NODE, INTER_GBPS, SEQ = "H100-SXM", 8, 3200, 4096  # 8 x 400G NICs per node
NODES = (1, 1024)
COMMANDS = [  # (model, nodes) run as the whole command
    ("llama-3.1-8b", 1),
    ("llama-3.1-70b", 1024),
    ("llama-3.1-405b", 1024),
    ("deepseek-v3", 1024),
]
COMPARE_MODEL = "llama-3.1-70b"

CHILD = """
import sys
sys.argv = {argv!r}
from llmctl.cli.main import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print("TORCH=%s" % ("torch" in sys.modules), file=sys.stderr)
"""


def child_cpu(args: list[str]) -> tuple[float, str]:
    """A fresh interpreter running `args` (python arguments): its CPU time (user + sys) and its stderr."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"{args!r} failed with exit {r.returncode}:\n{r.stderr[-2000:]}")
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, r.stderr


def command_cpu(argv: list[str], repeat: int) -> tuple[float, bool]:
    """The median CPU time of `llmctl ARGV` in a fresh interpreter, and whether torch was imported."""
    cpus, torch_seen = [], False
    for _ in range(repeat):
        cpu, err = child_cpu(["-c", CHILD.format(argv=["llmctl", *argv])])
        cpus.append(cpu)
        torch_seen |= "TORCH=False" not in err
    return statistics.median(cpus), torch_seen


def plan_argv(model: str, nodes: int) -> list[str]:
    return [
        "plan", model, "--gpu", GPU, "--nodes", str(nodes), "--gpus-per-node", str(GPUS_PER_NODE),
        "--inter-gbps", str(INTER_GBPS), "--seq-len", str(SEQ), "--json", "--no-write",
    ]  # fmt: skip


def in_process(model: str, nodes: int) -> tuple[float, str]:
    """CPU seconds of one plan() and what it chose (or 'does not fit')."""
    spec, gpu = resolve_model(model), resolve_gpu(GPU)
    net = cm.Network(gpu.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, INTER_GBPS / 8)
    req = PlanRequest(spec=spec, gpu=gpu, nodes=nodes, gpus_per_node=GPUS_PER_NODE, network=net, seq_len=SEQ)
    t = time.process_time()
    try:
        c = pl.plan(req).chosen.setup
        chosen = (
            f"{c.label}, {c.nodes} nodes" + (f" tp {c.tp}" if c.tp > 1 else "") + (f" cp {c.cp}" if c.cp > 1 else "")
        )
    except DoesNotFitError:
        chosen = "does not fit"
    return time.process_time() - t, chosen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3, help="fresh interpreters per end-to-end figure (median)")
    ap.add_argument("--models", help="comma-separated presets (default: the whole catalog)")
    args = ap.parse_args()
    failures = []

    torch_cpu = statistics.median(child_cpu(["-c", "import torch"])[0] for _ in range(args.repeat))
    print(f"`import torch` in a fresh interpreter: {torch_cpu:.3f} s CPU (median of {args.repeat})\n")

    models = args.models.split(",") if args.models else preset_names()
    print(f"1. One plan in-process, {GPUS_PER_NODE} x {GPU} per node, seq {SEQ} (bound {PLAN_BOUND_S} s CPU)")
    print(f"{'model':18s} {'nodes':>5s} {'CPU s':>7s} {'/bound':>7s}  chosen")
    resolve_gpu(GPU)
    worst = 0.0
    for model in models:
        resolve_model(model)
        for nodes in NODES:
            cpu, chosen = in_process(model, nodes)
            worst = max(worst, cpu)
            print(f"{model:18s} {nodes:5d} {cpu:7.3f} {cpu / PLAN_BOUND_S:7.2f}  {chosen}")
            if cpu >= PLAN_BOUND_S:
                failures.append(f"plan {model} on {nodes} nodes: {cpu:.3f} s CPU >= {PLAN_BOUND_S} s")
    print(f"slowest: {worst:.3f} s ({worst / PLAN_BOUND_S:.2f} x the bound)\n")

    limit = COMMAND_BOUND * torch_cpu
    print(f"2. The whole command in a fresh interpreter (bound: {COMMAND_BOUND} x import torch = {limit:.3f} s CPU)")
    print(f"{'model':18s} {'nodes':>5s} {'CPU s':>7s} {'/torch':>7s} {'/bound':>7s}")
    for model, nodes in COMMANDS:
        cpu, torch_seen = command_cpu(plan_argv(model, nodes), args.repeat)
        print(f"{model:18s} {nodes:5d} {cpu:7.3f} {cpu / torch_cpu:7.2f} {cpu / limit:7.2f}")
        if torch_seen:
            failures.append(f"plan {model} on {nodes} nodes imported torch")
        if cpu >= limit:
            failures.append(f"command plan {model} on {nodes} nodes: {cpu:.3f} s CPU >= {limit:.3f} s")
    cpu, torch_seen = command_cpu(["--help"], args.repeat)
    print(f"{'llmctl --help':24s} {cpu:7.3f} {cpu / torch_cpu:7.2f} {cpu / limit:7.2f}  (not bounded)\n")

    print(f"3. `llmctl plan {COMPARE_MODEL} --compare all --tokens 1T --json` (bound {COMPARE_BOUND_S} s CPU)")
    cpu, torch_seen = command_cpu(["plan", COMPARE_MODEL, "--compare", "all", "--tokens", "1T", "--json"], 1)
    print(f"{cpu:.3f} s CPU ({cpu / COMPARE_BOUND_S:.2f} x the bound)\n")
    if torch_seen:
        failures.append("--compare all imported torch")
    if cpu >= COMPARE_BOUND_S:
        failures.append(f"--compare all: {cpu:.3f} s CPU >= {COMPARE_BOUND_S} s")

    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print("OK: every bound met, torch never imported")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
