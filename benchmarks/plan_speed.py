"""How long `llmctl plan` takes for big clusters, and that it never imports torch.

Two timings per case, median of --repeat runs:
- in-process: `llmctl.plan.planner.plan()` alone (enumeration + memory model + cost model);
- end to end: `llmctl plan ... --json --no-write` in a fresh interpreter, from process start to exit (what a user
  waits for, imports included): wall time, and the child's CPU time (user + sys), which is what the wall time is
  on an idle machine (the shared 2-core box this was written on runs at load ~4, which inflates wall time).
The design's bound is "well under a second for thousands of GPUs"; the script exits non-zero if a 1,024-node plan
takes 1 s of CPU or more end to end, or if torch was imported.

Run: .venv/bin/python benchmarks/plan_speed.py [--repeat 3]
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
from llmctl.plan import comm as cm  # noqa: E402
from llmctl.plan import planner as pl  # noqa: E402
from llmctl.plan.request import PlanRequest  # noqa: E402
from llmctl.spec.hardware import resolve_gpu  # noqa: E402
from llmctl.spec.models import resolve_model  # noqa: E402

CASES = [  # model, gpu, nodes, gpus per node, inter-node Gbps, seq
    ("llama-2-7b", "A100-80GB", 2, 4, 50, 1024),
    ("llama-2-7b", "H100-SXM", 1024, 8, 3200, 4096),
    ("llama-3.1-70b", "H100-SXM", 1024, 8, 3200, 4096),
    ("llama-3.1-405b", "H100-SXM", 1024, 8, 3200, 4096),
]

CHILD = """
import sys, time
t = time.perf_counter()
sys.argv = ["llmctl", "plan", {model!r}, "--gpu", {gpu!r}, "--nodes", "{nodes}", "--gpus-per-node", "{g}",
            "--inter-gbps", "{gbps}", "--seq-len", "{seq}", "--json", "--no-write"]
from llmctl.cli.main import main
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print("TORCH=%s" % ("torch" in sys.modules), file=sys.stderr)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    failed = False
    print(
        f"{'model':16s} {'cluster':>18s} {'setups':>7s} {'plan() s':>9s} {'CLI wall s':>10s} {'CLI cpu s':>9s}  chosen"
    )
    for model, gpu, nodes, g, gbps, seq in CASES:
        spec, gspec = resolve_model(model), resolve_gpu(gpu)
        net = cm.Network(gspec.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, gbps / 8)
        inproc, result = [], None
        for _ in range(args.repeat):
            t = time.perf_counter()
            result = pl.plan(PlanRequest(spec=spec, gpu=gspec, nodes=nodes, gpus_per_node=g, network=net, seq_len=seq))
            inproc.append(time.perf_counter() - t)
        walls, cpus, torch_seen = [], [], False
        for _ in range(args.repeat):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-c", CHILD.format(model=model, gpu=gpu, nodes=nodes, g=g, gbps=gbps, seq=seq)],
                capture_output=True,
                text=True,
            )
            walls.append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            if r.returncode or "TORCH=False" not in r.stderr:
                torch_seen = True
                print(r.stderr[-1000:], file=sys.stderr)
        c, p = result.chosen.setup, result.chosen.predicted
        cli = statistics.median(cpus)
        print(
            f"{model:16s} {f'{nodes} x {g} {gpu}':>18s} {result.evaluated:7d} {statistics.median(inproc):9.3f} "
            f"{statistics.median(walls):10.3f} {cli:9.3f}  {c.strategy} over {c.nodes} nodes"
            f"{f' x TP {c.tp}' if c.tp > 1 else ''}, "
            f"mb {c.micro_batch_size} x {c.grad_accum_steps}, {c.checkpointing} ckpt, {c.attention}: "
            f"{p.tokens_per_s:,.0f} tok/s"
        )
        if torch_seen or (nodes >= 1024 and cli >= 1.0):
            failed = True
    print("FAIL" if failed else "OK: every 1,024-node plan under 1 s of CPU end to end, torch never imported")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
