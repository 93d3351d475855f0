"""llmctl bench-net's all-reduce busbw against a plain torch.distributed loop, on the same ranks.

The reference is written in the style of the widely used all_reduce_bench.py (stas00/ml-engineering, derived
from nccl-tests): refill the tensor, barrier, time back-to-back dist.all_reduce calls, algbw = size / duration
per call averaged over the ranks, busbw = algbw x 2(n-1)/n. llmctl's measurement (`llmctl.netbench.worker.time_collective`, the code
path of every point of the sweep) times each iteration as the slowest rank's.

The two alternate trial by trial (reference, llmctl, reference, llmctl, ...), so that a busy machine hurts both
alike, and each side's busbw is its median trial (all_reduce_bench's own mean is printed too). They must agree
within 10%; the ratio is printed. Last, a full `worker.run` sweep on the same ranks shows the end-to-end figure.

    python benchmarks/bench_net_vs_reference.py            # starts torchrun --standalone with 2 CPU ranks
    python benchmarks/bench_net_vs_reference.py --nproc 4 --sizes 16M,64M --trials 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def reference_trial_busbw_gbytes_s(tensor, size_bytes: int, calls: int) -> float:  # noqa: ANN001 - a Tensor
    """One all_reduce_bench-style trial on the default process group: `calls` back-to-back all-reduces timed
    together, busbw of the rank-averaged algbw."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    cuda = tensor.is_cuda
    tensor.uniform_()  # refill outside the timed region (in-place sums would grow without bound)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(tensor)
    if cuda:
        torch.cuda.synchronize()
    duration = (time.perf_counter() - start) / calls
    algbw = torch.tensor([size_bytes / duration], dtype=torch.float64)
    dist.all_reduce(algbw)  # all_reduce_bench's mean over ranks
    return algbw.item() / n * 2 * (n - 1) / n / 1e9  # nccl-tests' bus factor for all-reduce


def rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from llmctl.netbench import worker
    from llmctl.netbench.options import WorkerConfig, parse_sizes
    from llmctl.spec.bench import busbw_gbytes_s
    from llmctl.units import fmt_bytes

    sizes = parse_sizes(args.sizes)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    n = dist.get_world_size()
    ref: dict[int, list[float]] = {}
    ours: dict[int, list[float]] = {}
    for s in sizes:
        tensor = torch.empty(s // 4, dtype=torch.float32, device="cuda" if cuda else "cpu")
        # all_reduce_bench queues up to 10 calls per trial (fewer for big payloads); the same count as llmctl's
        calls = worker.calls_per_iter(s, cuda)
        for _ in range(args.warmup):
            reference_trial_busbw_gbytes_s(tensor, s, calls)
            worker.time_collective("all_reduce", s, iters=1)
        ref[s], ours[s] = [], []
        for _ in range(args.trials):
            ref[s].append(reference_trial_busbw_gbytes_s(tensor, s, calls))
            (t,) = worker.time_collective("all_reduce", s, iters=1)
            ours[s].append(busbw_gbytes_s("all_reduce", n, s, t))
        del tensor
    with tempfile.TemporaryDirectory() as tmp:  # the whole worker, end to end, on the same process group
        cfg = WorkerConfig(
            json_path=f"{tmp}/bench.json",
            sizes=args.sizes,
            iters=args.trials // 2,
            warmup=args.warmup,
            collectives="all_reduce",
            progress=False,
            dtype="fp32",
        )
        report = worker.run(cfg)
    dist.destroy_process_group()
    if report is None:
        return 0
    sweep = {p.size_bytes: p.busbw_gbytes_s for p in report.result("world", "all_reduce").points}
    print(f"\nall-reduce busbw (GB/s), {n} ranks, {report.backend}, fp32, {args.trials} alternating trials per size")
    print(
        f"| {'size':>7} | {'reference':>9} | {'(ref mean)':>10} | {'llmctl':>8} | {'llmctl/ref':>10} |"
        f" {'llmctl sweep':>12} |"
    )
    print(f"| {'-' * 7}:| {'-' * 9}:| {'-' * 10}:| {'-' * 8}:| {'-' * 10}:| {'-' * 12}:|")
    worst = 1.0
    for s in sizes:
        r, o = statistics.median(ref[s]), statistics.median(ours[s])
        ratio = o / r
        worst = ratio if abs(ratio - 1) > abs(worst - 1) else worst
        print(
            f"| {fmt_bytes(s):>7} | {r:>9.3f} | {statistics.mean(ref[s]):>10.3f} | {o:>8.3f} | {ratio:>10.3f} |"
            f" {sweep[s]:>12.3f} |"
        )
    ok = abs(worst - 1) <= args.tolerance
    print(
        f"{'PASS' if ok else 'FAIL'}: worst llmctl/reference ratio {worst:.3f} (must be within "
        f"{args.tolerance:.0%} of 1)"
    )
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizes", default="4M,16M,64M")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args()
    if "RANK" in os.environ:
        return rank_main(args)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        env.setdefault("TMPDIR", tmp)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.nproc),
            __file__,
            *sys.argv[1:],
        ]
        rc = subprocess.run(cmd, env=env, stderr=subprocess.PIPE, text=True)
    if rc.returncode != 0:
        # torchrun's failure report is long; a FAIL line above already says why when the ranks got that far
        print(rc.stderr.strip().splitlines()[-1] if rc.stderr.strip() else "torchrun failed", file=sys.stderr)
    return rc.returncode


if __name__ == "__main__":
    sys.exit(main())
