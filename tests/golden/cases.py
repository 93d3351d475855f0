"""The `--json` outputs of `llmctl estimate-memory` and `llmctl plan` (and the plan files `plan` writes) for a fixed
set of cases, recorded as golden files: refactors of the setup, the families or the planner must leave every figure
identical (tests/golden/test_golden_outputs.py). Regenerate on purpose only, when a number is meant to change:

    .venv/bin/python -m tests.golden.cases   # rewrites tests/golden/outputs/*.json and say which changed

Each case names what it covers: families (dense, GQA, MoE, sliding windows, MLA, GPT-2), every strategy, every
checkpointing mode, both attention kernels, fp32/bf16/pure bf16, fp16-mixed (auto on a V100), float8 (tensorwise and
rowwise, refused on an A100), the zero ledger, a measured model type, a calibrated plan, a cost objective, pins,
context parallelism at 128k tokens, CPU offload (70B on 8 A100: pinned and refused for host memory, and chosen when
nothing fits without it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
OUTPUTS = HERE / "outputs"
ROOT = HERE.parent.parent
SEED = str(ROOT / "examples/clusters/plan-a100-2x4-50gbps.yaml")
IB = str(ROOT / "examples/clusters/plan-h100-4x8-ib.yaml")

# {measured}: the config.json of a model type measured on fake tensors; {calib}: an engine metrics file; {plan}: where
# `plan -o` writes (its text is recorded too).
# fmt: off
ESTIMATE: dict[str, list[str]] = {
    "est-llama2-7b-seed-full-flash": [
        "llama-2-7b", "--gpu", "A100-80GB", "--nodes", "2", "--gpus-per-node", "4", "--seq-len", "1024",
        "--checkpointing", "full", "--attention", "flash",
    ],
    "est-llama31-8b-fp32-partial-eager-chunk": [
        "llama-3.1-8b", "--gpu", "A100-80GB", "--gpus", "8", "--precision", "fp32", "--checkpointing", "partial:3",
        "--attention", "eager", "--loss-chunk", "2048", "--seq-len", "2048",
    ],
    "est-qwen3-moe-h100": ["qwen3-30b-a3b", "--gpu", "H100-SXM", "--gpus", "8", "--seq-len", "4096"],
    "est-mixtral-hybrid-selective": [
        "mixtral-8x7b", "--gpu", "H100-SXM", "--nodes", "2", "--gpus-per-node", "8", "--strategy", "hybrid_shard",
        "--checkpointing", "selective",
    ],
    "est-gemma2-bf16-pure-noshard": [
        "gemma-2-9b", "--gpu", "H100-SXM", "--gpus", "8", "--precision", "bf16", "--strategy", "no_shard",
        "--checkpointing", "full",
    ],
    "est-deepseek-v3-mla-tp-zero1": [
        "deepseek-v3", "--gpu", "H100-SXM", "--nodes", "32", "--gpus-per-node", "8", "--tp", "8", "--engine", "zero",
        "--strategy", "zero1", "--checkpointing", "full",
    ],
    "est-llama31-70b-tp-pp": [
        "llama-3.1-70b", "--gpu", "H100-SXM", "--gpus", "16", "--tp", "4", "--pp", "2", "--checkpointing", "selective",
    ],
    "est-refused-tp-pp-split": ["llama-2-7b", "--gpu", "H100-SXM", "--gpus", "8", "--tp", "8", "--pp", "4"],
    "est-gpt2-xl-adafactor-sgo": [
        "gpt2-xl", "--gpu", "A100-40GB", "--gpus", "4", "--optimizer", "adafactor", "--strategy", "shard_grad_op",
        "--engine", "zero", "--attention", "eager", "--micro-batch", "4", "--seq-len", "1024",
    ],
    "est-params-7b": ["--params", "7B", "--gpu", "A100-80GB", "--gpus", "8"],
    "est-gpt-oss-20b-sliding-sinks": ["gpt-oss-20b", "--gpu", "H100-SXM", "--gpus", "8", "--checkpointing", "full"],
    "est-measured-granite": ["{measured}", "--gpu", "H100-SXM", "--gpus", "8", "--seq-len", "1024"],
    "est-llama31-8b-cp4-128k": [
        "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--cp", "4", "--seq-len", "128k", "--checkpointing",
        "full", "--loss-chunk", "512",
    ],
    "est-llama31-8b-fp8-h100": [
        "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--precision", "fp8", "--micro-batch", "2",
    ],
    "est-mixtral-fp8-rowwise-selective": [
        "mixtral-8x7b", "--gpu", "H200", "--gpus", "8", "--precision", "fp8-rowwise", "--checkpointing", "selective",
    ],
    "est-refused-fp8-a100": ["llama-3.1-8b", "--gpu", "A100-80GB", "--gpus", "8", "--precision", "fp8"],
    "est-gpt2-xl-v100-auto": ["gpt2-xl", "--gpu", "V100-16GB", "--gpus", "4", "--seq-len", "1024"],
    "est-llama31-70b-offload-a100": ["llama-3.1-70b", "--gpu", "A100-80GB", "--gpus", "8", "--offload"],
}
PLAN: dict[str, list[str]] = {
    "plan-seed": ["llama-2-7b", "--cluster", SEED, "--seq-len", "1024", "--tokens", "2B", "-o", "{plan}"],
    "plan-seed-naive-pinned": [
        "llama-2-7b", "--cluster", SEED, "--seq-len", "1024", "--strategy", "full_shard", "--checkpointing", "none",
        "--attention", "eager", "--no-compile", "--micro-batch", "1", "--no-write",
    ],
    "plan-seed-cost": [
        "llama-2-7b", "--cluster", SEED, "--seq-len", "1024", "--tokens", "2B", "--objective", "cost", "--top", "3",
        "--no-write",
    ],
    "plan-seed-calibrated": ["llama-2-7b", "--cluster", SEED, "--seq-len", "1024", "--calibrate", "{calib}", "--no-write"],
    "plan-llama31-70b-ib": [
        "llama-3.1-70b", "--cluster", IB, "--seq-len", "4096", "--tokens", "10B", "-o", "{plan}",
    ],
    "plan-mistral-8k-h100": [
        "mistral-7b", "--gpu", "H100-SXM", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "8192",
        "--global-batch", "64", "-o", "{plan}",
    ],
    "plan-qwen3-moe-2node": [
        "qwen3-30b-a3b", "--gpu", "H100-SXM", "--nodes", "2", "--gpus-per-node", "8", "--inter-gbps", "400",
        "--seq-len", "4096", "--price", "2.5", "--tokens", "50B", "-o", "{plan}",
    ],
    "plan-gemma3-fp32-l40s": [
        "gemma-3-1b", "--gpu", "L40S", "--nodes", "1", "--gpus-per-node", "4", "--precision", "fp32", "--seq-len",
        "2048", "--no-write",
    ],
    "plan-tiny-cpu-like": [
        "llama-tiny", "--gpu", "A100-80GB", "--gpus-per-node", "2", "--precision", "fp32", "--seq-len", "128",
        "--global-batch", "16", "-o", "{plan}",
    ],
    "plan-llama31-8b-128k-cp": [
        "llama-3.1-8b", "--gpu", "H100-SXM", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "128k", "-o",
        "{plan}",
    ],
    "plan-measured-granite": [
        "{measured}", "--gpu", "H100-SXM", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "1024", "-o", "{plan}",
    ],
    "plan-gpt2-xl-v100-auto": ["gpt2-xl", "--gpu", "V100-16GB", "--nodes", "1", "--gpus-per-node", "4", "-o", "{plan}"],
    "plan-llama31-8b-fp8-h100": [
        "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--precision", "fp8", "-o", "{plan}",
    ],
    "plan-llama31-8b-bf16-h100": [
        "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--tp", "1", "--no-write",
    ],
    "plan-llama31-70b-offload-a100": ["llama-3.1-70b", "--gpu", "A100-80GB", "--gpus", "8", "--offload", "--no-write"],
    "plan-llama31-70b-a100-bf16-states": [
        "llama-3.1-70b", "--gpu", "A100-80GB", "--gpus", "8", "--optimizer-states", "bf16", "-o", "{plan}",
    ],
}
# fmt: on


def calibration_metrics(path: Path) -> Path:
    """An engine run's metrics: measured 15,000 tokens/s against 20,000 predicted (calibration 0.75)."""
    rows: list[dict[str, Any]] = [{"event": "start", "step": 0}]
    rows += [
        {"event": "step", "step": i, "tokens_per_s": 15000.0 + 100 * i, "tokens_per_s_predicted": 20000.0}
        for i in range(1, 6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def measured_config(folder: Path) -> Path:
    from tests.family_configs import OTHERS

    path = folder / "granite" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(next(c for c in OTHERS if c["model_type"] == "granite")))
    return path


def run_case(name: str, work: Path) -> dict[str, Any]:
    """One case's output as recorded: {"argv", "exit_code", "json", "plan_yaml"}; paths under `work` written as
    placeholders."""
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    command, args = ("estimate-memory", ESTIMATE[name]) if name in ESTIMATE else ("plan", PLAN[name])
    plan_path = work / f"{name}.yaml"
    subs = {
        "{measured}": str(measured_config(work)),
        "{calib}": str(calibration_metrics(work / "metrics.jsonl")),
        "{plan}": str(plan_path),
    }
    argv = [command, *(subs.get(a, a) for a in args), "--json"]
    r = CliRunner().invoke(app, argv)
    out: dict[str, Any] = {"argv": [command, *args], "exit_code": r.exit_code}
    text = (r.stdout if r.exit_code == 0 else r.output).replace(str(work), "{work}").replace(str(ROOT), "{root}")
    out["json"] = json.loads(text) if r.exit_code == 0 else text
    out["plan_yaml"] = (
        plan_path.read_text().replace(str(work), "{work}").replace(str(ROOT), "{root}") if plan_path.exists() else None
    )
    return out


def names() -> list[str]:
    return [*ESTIMATE, *PLAN]


def main() -> int:
    import tempfile

    from llmctl.measure import cache, fake

    OUTPUTS.mkdir(exist_ok=True)
    changed = []
    with tempfile.TemporaryDirectory() as tmp:
        import os

        os.environ[cache.CACHE_ENV] = str(Path(tmp) / "cache")
        fake.install()
        for name in names():
            work = Path(tmp) / name
            work.mkdir()
            text = json.dumps(run_case(name, work), indent=1, sort_keys=True) + "\n"
            path = OUTPUTS / f"{name}.json"
            if not path.exists() or path.read_text() != text:
                changed.append(name)
                path.write_text(text)
    print(f"{len(names())} cases, changed: {', '.join(changed) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
