"""bench-net's quick mode, the torch half of the launch preflight (`llmctl.launch.preflight` starts it on the nodes
of a SLURM job, before training). Two commands, each run by every rank:

    python -m llmctl.netbench.quick node --out DIR [--expect-gpus G] ...   (ranks started as torchrun --standalone
                                                                             would: RANK, LOCAL_RANK, MASTER_PORT, ...)
    torchrun --nnodes N ... -m llmctl.netbench.quick cross --out DIR

`node`, on one node alone: are the devices there (G GPUs, each with at least the memory the plan predicts; on a
CPU: the K ranks start), then one all-reduce among the node's K ranks, checked and timed with bench-net's own
measurement (`worker.time_collective`). Local rank 0 writes DIR/node-<name>.json, passed or failed (the paths:
llmctl.netbench.quick_files).

`cross`, on the nodes that passed, together: bench-net's worker (`worker.run`) in quick mode
(`WorkerConfig.quick`: the all-reduce over all nodes, inside and across nodes, a few pairwise rounds, one
message size); rank 0 writes DIR/bench.json, whose node verdicts are bench-net's slow-node rules.

Failures are one line on stderr and a record in $LLMCTL_ERROR_FILE (llmctl.errors.report).

Test hook: LLMCTL_PREFLIGHT_FAIL_NODE=node2[,node5] makes the node check fail on the nodes so named (SLURM's
node name, $LLMCTL_NODE_NAME): how the tests simulate a broken node. Never set it outside a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from llmctl.errors import LlmctlError, RuntimeFailure
from llmctl.errors import report as report_error
from llmctl.fileio import write_atomic
from llmctl.netbench import options as opts
from llmctl.netbench import worker
from llmctl.netbench.quick_files import bench_path, node_result_path
from llmctl.spec.bench import aligned_size, busbw_gbytes_s
from llmctl.units import fmt_bytes

FAIL_NODE_ENV = "LLMCTL_PREFLIGHT_FAIL_NODE"


def _fail_hook(node: str) -> None:
    named = [n.strip() for n in os.environ.get(FAIL_NODE_ENV, "").split(",") if n.strip()]
    if node in named:
        raise RuntimeFailure(f"failing on purpose: {FAIL_NODE_ENV} names {node} (a test hook)")


def _devices(env: opts.DistEnv, expect_gpus: int, min_gpu_memory_bytes: int | None) -> tuple[torch.device, str]:
    """This rank's device, checked against what the plan expects; and a name for it."""
    if expect_gpus == 0:
        return torch.device("cpu"), "cpu"
    if not torch.cuda.is_available():
        raise RuntimeFailure(f"no GPU visible (the plan runs {expect_gpus} per node)")
    found = torch.cuda.device_count()
    if found < expect_gpus or env.local_rank >= found:
        raise RuntimeFailure(f"{found} GPU(s) visible, the plan runs {expect_gpus} per node")
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    props = torch.cuda.get_device_properties(device)
    if min_gpu_memory_bytes and props.total_memory < min_gpu_memory_bytes:
        raise RuntimeFailure(
            f"GPU {env.local_rank} ({props.name}) has {fmt_bytes(props.total_memory)}, "
            f"less than the {fmt_bytes(min_gpu_memory_bytes)} per GPU the plan predicts"
        )
    return device, props.name


def node_check(out: Path, expect_gpus: int, min_gpu_memory_bytes: int | None, timeout_s: float) -> dict:
    """The node check on this rank; local rank 0 returns (and writes) the node's result."""
    t0 = time.monotonic()
    env = opts.dist_env()
    name = opts.node_name()
    result: dict = {"node": name, "ok": False, "ranks": env.local_world_size}
    try:
        _fail_hook(name)
        device, device_name = _devices(env, expect_gpus, min_gpu_memory_bytes)
        result["device"] = device_name
        on_gpu = device.type == "cuda"
        dist.init_process_group(
            "nccl" if on_gpu else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if on_gpu else None,
        )
        try:
            n = dist.get_world_size()
            probe = torch.ones(1, device=device)
            dist.all_reduce(probe)
            if int(probe.item()) != n:
                raise RuntimeFailure(f"all-reduce of ones over the node's {n} ranks gave {probe.item()}")
            if n >= 2:
                dtype = torch.bfloat16 if on_gpu else torch.float32
                size = aligned_size(
                    opts.parse_size(opts.QUICK_SIZE_GPU if on_gpu else opts.QUICK_SIZE_CPU), n, dtype.itemsize
                )
                times = worker.time_collective("all_reduce", size, iters=opts.QUICK_ITERS, warmup=1, dtype=dtype)
                result["intra_busbw_gbytes_s"] = busbw_gbytes_s("all_reduce", n, size, statistics.median(times))
                result["size_bytes"] = size
        finally:
            dist.destroy_process_group()
        result["ok"] = True
    except LlmctlError as e:
        result["error"] = str(e)
        raise
    except Exception as e:  # a collective that failed or timed out: the node failed, say how
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        result["error"] = first
        raise RuntimeFailure(f"node check on {name}: {first}") from None
    finally:
        result["seconds"] = round(time.monotonic() - t0, 3)
        if env.local_rank == 0:
            write_atomic(node_result_path(out, name), json.dumps(result) + "\n")
    return result


def cross(out: Path, timeout_s: float) -> None:
    """bench-net's worker in quick mode on every rank; rank 0 writes DIR/bench.json."""
    cfg = opts.WorkerConfig.quick(str(bench_path(out)), on_gpu=torch.cuda.is_available(), timeout_s=timeout_s)
    worker.run(cfg)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m llmctl.netbench.quick", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["node", "cross"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--expect-gpus", type=int, default=0)
    p.add_argument("--min-gpu-memory-bytes", type=int)
    p.add_argument("--timeout-s", type=float, default=60.0)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if a.mode == "node":
            node_check(a.out, a.expect_gpus, a.min_gpu_memory_bytes, a.timeout_s)
        else:
            cross(a.out, a.timeout_s)
    except BaseException as e:
        code = report_error(e, rank=rank, say=True)
    else:
        code = 0
    # Skip the interpreter's teardown, as the engine does after a finished run: torch's takes seconds, and a process
    # group torn down mid-failure can hang or abort a rank. The results are written (atomically) already.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
