"""The planner's step split for Llama-3.1-8B at 2k, 8k and 32k tokens on A100 and H100, and how its tokens/s compares
with what a user would estimate without it (one efficiency for the whole step: 6N + attention FLOPs at a fixed
fraction of peak), side by side; then the same model against the H100 runs measured through the engine
(docs/measurements/h100-gpu-tier.json), where the one-efficiency estimate is checked too.

1. For each GPU and length: `llmctl plan` on 8 GPUs of one node (FULL_SHARD, global batch 64 sequences, the
   planner's own choice of micro-batch, checkpointing and kernel), the chosen setup's seconds per step by kind
   (matmuls, attention, memory-bound ops, FSDP copies and optimizer, exposed communication), the attention share,
   the predicted tokens/s per GPU, and what one efficiency (ONE_EFFICIENCY of peak, in hardware FLOPs with the same
   recompute) gives for the same setup: the ratio shows where one number misleads (long sequences on H100, where
   attention runs at a third of the matmuls' rate).
2. For every full-training speed run the H100 recorded: measured tokens/s, the planner's for the same pinned setup,
   the one-efficiency estimate's, and each one's ratio to the measurement.

Run: .venv/bin/python benchmarks/step_split.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "plan"))
from llmctl.plan import comm as cm  # noqa: E402
from llmctl.plan import flops as fl  # noqa: E402
from llmctl.plan import planner as pl  # noqa: E402
from llmctl.plan.request import PlanRequest  # noqa: E402
from llmctl.plan.timing import STEP_KINDS, evaluate  # noqa: E402
from llmctl.spec.hardware import resolve_gpu  # noqa: E402
from llmctl.spec.models import resolve_model  # noqa: E402


def request(model: str, gpu: str, gpus: int, seq: int, batch: int, **pins) -> PlanRequest:
    """One node of `gpus` GPUs, NVLink at the catalog's link x 0.75 (the planner's default without a bench-net
    report is the same order; the split's compute does not depend on it)."""
    g = resolve_gpu(gpu)
    net = cm.Network(g.link_gbytes_s * 0.75, None)
    spec = resolve_model(model)
    return PlanRequest(
        spec=spec, gpu=g, nodes=1, gpus_per_node=gpus, network=net, seq_len=seq, global_batch_seqs=batch, **pins
    )


ONE_EFFICIENCY = 0.45
"""The alternative: a whole step at 45% of peak in hardware FLOPs (the middle of the 40-50% MFU that torchtitan and
Megatron report for dense models on H100 at 4-8k tokens; a planning rule of thumb, not a measurement here)."""


def one_efficiency_tps(req, c) -> float:
    s = c.setup
    hw = fl.hardware_flops_per_token(req.spec, req.seq_len, s.checkpointing, s.attention, s.loss_chunk_tokens > 0)
    per_gpu = req.gpu.peak_tflops(req.compute_dtype) * 1e12 * ONE_EFFICIENCY / hw
    return per_gpu * s.gpus


def part1() -> None:
    print("Llama-3.1-8B, 8 GPUs in one node, global batch 64 sequences: the chosen setup's step by kind")
    head = f"{'gpu':10s} {'seq':>6s} {'setup':34s} " + " ".join(f"{k[:9]:>9s}" for k in STEP_KINDS)
    print(head + f" {'attn%':>6s} {'tok/s/GPU':>10s} {'one-eff':>9s} {'ratio':>6s}")
    for gpu in ("A100-80GB", "H100-SXM"):
        for seq in (2048, 8192, 32768):
            req = request("llama-3.1-8b", gpu, 8, seq, 64, tp=1, cp=1)
            c = pl.plan(req).chosen
            p, s = c.predicted, c.setup
            total = sum(p.split.values())
            setup = f"mb {s.micro_batch_size}x{s.grad_accum_steps} {s.checkpointing} {s.attention}"
            cells = " ".join(f"{p.split[k]:9.2f}" for k in STEP_KINDS)
            one = one_efficiency_tps(req, c) / s.gpus
            print(
                f"{gpu:10s} {seq:6d} {setup:34s} {cells} {p.split['attention'] / total:6.0%} "
                f"{p.tokens_per_s_per_gpu:10,.0f} {one:9,.0f} {one / p.tokens_per_s_per_gpu:6.2f}"
            )
    print("(seconds per optimizer step; one-eff: tokens/s per GPU at one efficiency; ratio: one-eff / planner)\n")


def part2() -> None:
    import test_measured_h100 as m  # the tier's runs and their pinned setups

    print("H100 runs through the engine (docs/measurements/h100-gpu-tier.json): measured / predicted tokens/s")
    print(f"{'run':28s} {'measured':>9s} {'planner':>9s} {'ratio':>6s} {'one-eff':>9s} {'ratio':>6s}")
    planner_err, one_err = [], []
    for key in m.SPEEDS:
        if "lora" in key:
            continue
        ratio, _, got = m.predicted_run(key)
        measured = got["tokens_per_s"]
        model, seq, precision, _ = m.SPEEDS[key]
        req = request(model, "H100-SXM", 1, seq, 8, precision=precision)
        mb, acc = (int(x) for x in got["setup"].split(",")[0].removeprefix("mb ").split("x"))
        ck = got["setup"].split(", ")[1]
        setup = req.setup("full_shard", 1, mb, acc, ck, "sdpa", True, 0)
        one = one_efficiency_tps(req, evaluate(req, setup))
        planner_err.append(abs(ratio - 1))
        one_err.append(abs(measured / one - 1))
        print(f"{key:28s} {measured:9,.0f} {measured / ratio:9,.0f} {ratio:6.2f} {one:9,.0f} {measured / one:6.2f}")
    print(
        f"median |error|: planner {statistics.median(planner_err):.0%}, one efficiency "
        f"{statistics.median(one_err):.0%} (worst {max(planner_err):.0%} vs {max(one_err):.0%})"
    )


if __name__ == "__main__":
    part1()
    part2()
