"""The GPU tier: what only a CUDA machine can check (conftest.py: skipped with the reason elsewhere).

- Kernel throughput (llmctl.measure.kernels): SDPA's flash, cuDNN and memory-efficient attention forward and
  backward by head dimension and sequence length, matmuls by shape class in bf16 and float8, memory-bound ops.
- The engine on CUDA + NCCL: a tiny run through `llmctl launch` (local torchrun) in bf16 with SDPA (flash-attn where
  installed) and torch.compile; fp16 with loss scaling (an injected overflow skips one step and halves the scale);
  float8 (torchao) where the GPU has it.
- The memory estimate against the caching allocator for three setups of Llama-3.2-1B (1.24B parameters): peak
  allocated within 5% of `estimate-memory`'s peak allocated; reserved against the plan's memory per GPU, and the
  allocator's retries, recorded.
- `llmctl plan`'s predicted tokens/s against the engine's measured tokens/s for Llama-3.2-1B on this GPU (bf16, and
  float8 where the GPU has it): the ratio recorded in the report (a loose bound is asserted; the figure is the point).
- bench-net and FSDP x TP need 2 GPUs: skipped with the reason on one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmctl.spec.kernels import architecture_of, sdpa_kernel
from tests.gpu.conftest import REPO, events, flash_attn_importable, record, run

TINY_OVERRIDES = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
BIG = "llama-3.2-1b"
SEQ = 2048


def gpu_kind() -> str:
    """The catalog name of this GPU for --gpu (the catalog resolves aliases such as H100 and A100-80GB)."""
    import torch

    name = torch.cuda.get_device_name(0)
    for kind, keys in (
        ("H200", ("H200",)),
        ("H100", ("H100",)),
        ("A100-80GB", ("A100-SXM4-80GB", "A100 80GB")),
        ("A100", ("A100",)),
        ("L40S", ("L40S",)),
        ("L4", ("L4",)),
        ("A10G", ("A10G",)),
        ("T4", ("T4",)),
        ("V100", ("V100",)),
    ):
        if any(k in name for k in keys):
            return kind
    pytest.skip(f"this GPU ({name}) has no catalog entry the tier knows")


def capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability()


def has_bf16() -> bool:
    return capability() >= (8, 0)


def has_float8() -> tuple[bool, str]:
    import importlib.util

    if capability() < (8, 9):
        return False, f"float8 matmuls need compute capability 8.9+ (this GPU: {capability()})"
    if importlib.util.find_spec("torchao") is None:
        return False, "torchao is not installed (pip install 'llmctl[fp8]')"
    return True, ""


def qlora_skip(flags: tuple[str, ...]) -> None:
    """QLoRA's NF4 weights are torchao's: without it the engine refuses the plan in one line (exit 2), a setup this
    machine cannot run rather than a failure of the tier."""
    import importlib.util

    if "qlora" in flags and importlib.util.find_spec("torchao") is None:
        pytest.skip("QLoRA needs torchao, which is not installed (pip install 'llmctl[qlora]')")


def attention() -> str:
    return "flash" if flash_attn_importable() else "sdpa"


def tiny_plan(folder: Path, precision: str, steps: int, compile_: bool, **training: Any) -> Path:
    plan = {
        "name": f"gpu-tiny-{precision}",
        "model": {"preset": "llama-tiny", "overrides": TINY_OVERRIDES},
        "data": {"kind": "text", "paths": [str(REPO / "examples" / "corpus")]},
        "hardware": {"gpu": gpu_kind(), "nodes": 1, "nproc_per_node": 1},
        "parallel": {"sharding": "full_shard"},
        "training": {
            "precision": precision,
            "micro_batch_size": 8,
            "grad_accum_steps": 1,
            "seq_len": 256,
            "max_steps": steps,
            "seed": 0,
            "attention": attention(),
            "compile": compile_,
            **training,
        },
        "optimizer": {"lr": 3e-3, "warmup_steps": 3},
        "checkpoint": {"dir": str(folder / "ckpt"), "interval_steps": steps},
        "logging": {"dir": str(folder / "logs"), "interval_steps": 1},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def engine(plan: Path, timeout: float = 600, extra_env: dict[str, str] | None = None) -> Path:
    """`python -m llmctl.engine PLAN` (one process, one GPU); returns metrics.jsonl."""
    run(["-m", "llmctl.engine", str(plan)], timeout, extra_env)
    logs = yaml.safe_load(plan.read_text())["logging"]["dir"]
    return Path(logs) / "metrics.jsonl"


def falls(steps: list[dict[str, Any]]) -> bool:
    first, last = steps[0]["loss"], steps[-1]["loss"]
    return last < first - 0.5


def test_kernel_throughput(run_dir: Path, report: dict[str, Any]) -> None:
    out = run_dir / "kernels.json"
    run(["-m", "llmctl.measure.kernels", "-o", str(out)], 600)
    k = json.loads(out.read_text())
    gemm = {(p["shape"], p["dtype"]): p for p in k["gemm"] if "error" not in p}
    square = gemm[("square_8192", "bf16")]["tflops"]
    flash = [p for p in k["attention"] if p["kernel"] == "sdpa_flash" and "error" not in p]
    summary = {
        "gemm_tflops": {f"{s}/{d}": round(p["tflops"], 1) for (s, d), p in gemm.items()},
        "attention_tflops": {
            f"{p['kernel']}/d{p['head_dim']}/s{p['seq']}": (
                [round(p["fwd_tflops"], 1), round(p["bwd_tflops"], 1)] if "error" not in p else p["error"]
            )
            for p in k["attention"]
        },
        "memory_gbytes_s": {p["op"]: round(p.get("gbytes_s", 0.0), 1) for p in k["memory_bound"]},
        "seconds": k["seconds"],
    }
    record(report, "kernels", summary)
    assert square > 50, f"an 8192^3 bf16 matmul ran at {square:.1f} TFLOP/s"
    assert {64, 128} <= {p["head_dim"] for p in flash}, "SDPA's flash backend ran no point"
    # Backward does more work per FLOP than forward (FlashAttention-2, section 4): its throughput is lower.
    assert all(p["bwd_tflops"] < 1.2 * p["fwd_tflops"] for p in flash)
    if has_float8()[0]:
        assert gemm[("square_8192", "fp8")]["tflops"] > 1.3 * square, "float8 matmuls no faster than bf16"


def big_plan(folder: Path, *flags: str, steps: int = 6, model: str = BIG, seq: int = SEQ) -> Path:
    """`llmctl plan` for MODEL (Llama-3.2-1B) on this one GPU, a global batch of 8 sequences of synthetic data, with
    FLAGS pinned; no checkpoint (a 1B model's checkpoint is 15 GB of disk and tens of seconds that measure nothing)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "plan.yaml"
    tokens = steps * 8 * seq
    args = ["-m", "llmctl", "plan", model, "--gpu", gpu_kind(), "--gpus", "1", "--seq-len", str(seq)]
    args += ["--global-batch", "8", "--synthetic", "--run-dir", str(folder), "--tokens", str(tokens), "-o", str(path)]
    run([*args, "--attention", attention(), *flags], 300)
    data = yaml.safe_load(path.read_text())
    data["checkpoint"] = {"dir": None}
    data["logging"]["check_after_steps"] = 2
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


SPEED = {
    # id: (model, sequence length, precision, optimizer steps[, more plan flags])
    "bf16-mixed": (BIG, SEQ, "bf16-mixed", 16),
    "fp8-tensorwise": (BIG, SEQ, "fp8-tensorwise", 16),
    "1b-8k-bf16-mixed": (BIG, 8192, "bf16-mixed", 10),
    "1b-32k-bf16-mixed": (BIG, 32768, "bf16-mixed", 4),
    "3b-fp8-tensorwise": ("llama-3.2-3b", SEQ, "fp8-tensorwise", 10),
    "3b-bf16-mixed": ("llama-3.2-3b", SEQ, "bf16-mixed", 10),
    "1b-lora-bf16-mixed": (BIG, SEQ, "bf16-mixed", 16, ("--finetune", "lora")),
    "3b-lora-bf16-mixed": ("llama-3.2-3b", SEQ, "bf16-mixed", 10, ("--finetune", "lora")),
    "1b-qlora-bf16-mixed": (BIG, SEQ, "bf16-mixed", 16, ("--finetune", "qlora")),
    # FSDP2's CPUOffloadPolicy: the states on the host, the AdamW step on the CPU, the copies over PCIe
    "1b-offload-bf16-mixed": (BIG, SEQ, "bf16-mixed", 6, ("--offload",)),
}


@pytest.mark.parametrize("name", list(SPEED))
def test_measured_tokens_per_s_against_the_plan(name: str, run_dir: Path, report: dict[str, Any]) -> None:
    model, seq, precision, n, *more = SPEED[name]
    if not has_bf16():
        pytest.skip(f"bf16 needs compute capability 8.0+ (this GPU: {capability()})")
    if precision.startswith("fp8") and not has_float8()[0]:
        pytest.skip(has_float8()[1])
    qlora_skip(tuple(more[0]) if more else ())
    folder = run_dir / f"speed-{name}"
    plan = big_plan(folder, "--precision", precision, *(more[0] if more else ()), steps=n, model=model, seq=seq)
    data = yaml.safe_load(plan.read_text())
    steps = events(engine(plan), "step")
    checks = events(folder / "metrics.jsonl", "plan_check")
    warm = steps[len(steps) // 2 :]  # past compilation and the allocator's first growth
    measured = sum(s["tokens_per_s"] for s in warm) / len(warm)
    want = data["predicted"]["tokens_per_s"]
    t = data["training"]
    got = {
        "model": f"{model} at {seq} tokens, {precision}",
        "setup": f"mb {t['micro_batch_size']}x{t['grad_accum_steps']}, {t['activation_checkpointing']}, "
        f"{t['attention']}, compile {t['compile']}",
        "tokens_per_s": measured,
        "tokens_per_s_predicted": want,
        "ratio_measured_over_predicted": measured / want,
        "mfu": warm[-1].get("mfu"),
        "mfu_predicted": data["predicted"]["mfu"],
        "peak_reserved_gib": steps[-1]["peak_mem_reserved_bytes"] / 2**30,
        "alloc_retries": steps[-1]["alloc_retries"],
        "plan_check": checks[-1] if checks else None,
    }
    record(report, f"speed/{name}", got)
    assert 0.3 < got["ratio_measured_over_predicted"] < 3, got


MEMORY_SETUPS = {
    "mb8-none": ("--micro-batch", "8", "--checkpointing", "none"),
    "mb8-full": ("--micro-batch", "8", "--checkpointing", "full"),
    "mb4-selective": ("--micro-batch", "4", "--checkpointing", "selective"),
    "mb2-none": ("--micro-batch", "2", "--checkpointing", "none"),
    "mb8-full-chunk4k": ("--micro-batch", "8", "--checkpointing", "full", "--loss-chunk", "4096"),
    "lora-mb8-none": ("--micro-batch", "8", "--checkpointing", "none", "--finetune", "lora"),
    "lora-mb8-full": ("--micro-batch", "8", "--checkpointing", "full", "--finetune", "lora"),
    "qlora-mb8-full": ("--micro-batch", "8", "--checkpointing", "full", "--finetune", "qlora"),
    "offload-mb8-full": ("--micro-batch", "8", "--checkpointing", "full", "--offload"),
}


@pytest.mark.parametrize("name", list(MEMORY_SETUPS))
def test_memory_estimate_against_the_allocator(name: str, run_dir: Path, report: dict[str, Any]) -> None:
    if not has_bf16():
        pytest.skip(f"the 1B runs are bf16-mixed: compute capability 8.0+ (this GPU: {capability()})")
    flags = MEMORY_SETUPS[name]
    qlora_skip(flags)
    folder = run_dir / f"mem-{name}"
    plan = big_plan(folder, *flags, "--no-compile", "--precision", "bf16-mixed", steps=4)
    doc = yaml.safe_load(plan.read_text())
    t, ft = doc["training"], doc.get("finetune") or {"method": "full"}
    method = ["--finetune", ft["method"]] + (["--lora-rank", str(ft["lora_rank"])] if ft["method"] != "full" else [])
    method += ["--offload"] if (doc.get("parallel") or {}).get("offload") else []
    est = json.loads(
        run(
            ["-m", "llmctl", "estimate-memory", BIG, "--gpu", gpu_kind(), "--gpus", "1", "--seq-len", str(SEQ)]
            + ["--micro-batch", str(t["micro_batch_size"]), "--checkpointing", t["activation_checkpointing"]]
            + ["--grad-accum", str(t["grad_accum_steps"]), "--loss-chunk", str(t["loss_chunk_tokens"])]
            + ["--attention", attention(), "--precision", "bf16-mixed", "--engine", "fsdp2", *method, "--json"],
            300,
        ).stdout
    )
    steps = events(engine(plan), "step")
    last = steps[-1]
    predicted = yaml.safe_load(plan.read_text())["predicted"]["memory_per_gpu_bytes"]
    got = {
        "peak_allocated_gib": last["peak_mem_allocated_bytes"] / 2**30,
        "estimate_allocated_gib": est["peak_allocated_bytes"] / 2**30,
        "allocated_ratio": last["peak_mem_allocated_bytes"] / est["peak_allocated_bytes"],
        "peak_reserved_gib": last["peak_mem_reserved_bytes"] / 2**30,
        "plan_memory_per_gpu_gib": predicted / 2**30,
        "reserved_vs_plan": last["peak_mem_reserved_bytes"] / predicted,
        "alloc_retries": last["alloc_retries"],
        "phases_gib": {k: v / 2**30 for k, v in last["peak_mem_phase_bytes"].items()},
        "estimate_phases_gib": {k: v / 2**30 for k, v in est["phase_bytes"].items()},
        "estimate_peak_phase": est["peak_phase"],
    }
    record(report, f"memory/{name}", got)
    assert max(last["peak_mem_phase_bytes"].values()) == last["peak_mem_allocated_bytes"]
    assert abs(got["allocated_ratio"] - 1) <= 0.05, got


def test_tiny_run_bf16_compiled_through_launch(run_dir: Path, report: dict[str, Any]) -> None:
    if not has_bf16():
        pytest.skip(f"bf16 needs compute capability 8.0+ (this GPU: {capability()})")
    folder = run_dir / "tiny-bf16"
    plan = tiny_plan(folder, "bf16-mixed", 30, True)
    p = run(["-m", "llmctl", "launch", str(plan)], 600)
    metrics = folder / "logs" / "metrics.jsonl"
    start, steps = events(metrics, "start")[-1], events(metrics, "step")
    record(
        report,
        "tiny_bf16_compile",
        {"attention": start["attention"], "losses": [steps[0]["loss"], steps[-1]["loss"]], "out": p.stdout[-300:]},
    )
    assert start["device"].startswith("cuda") and start["backend"] == "nccl"
    assert start["attention"] == ("flash_attention_2" if attention() == "flash" else "sdpa")
    if attention() == "sdpa":  # the kernel the plan priced, asked for first, and the one SDPA runs (engine/sdpa.py)
        want = sdpa_kernel(architecture_of(capability()), capability() >= (8, 0))
        assert start["sdpa"]["priced"] == want and start["sdpa"]["runs"] == want, start["sdpa"]
    assert len(steps) == 30 and falls(steps)
    assert steps[-1]["peak_mem_allocated_bytes"] > 0 and steps[-1]["alloc_retries"] == 0
    assert (folder / "ckpt").is_dir(), "no checkpoint written at the end"


def test_fp16_loss_scaling_skips_an_overflowed_step(run_dir: Path, report: dict[str, Any]) -> None:
    folder = run_dir / "tiny-fp16"
    plan = tiny_plan(folder, "fp16-mixed", 20, False)
    metrics = engine(plan, extra_env={"LLMCTL_ENGINE_TEST_OVERFLOW": "4:0"})
    start, steps = events(metrics, "start")[-1], events(metrics, "step")
    record(report, "tiny_fp16", {"scales": [s["loss_scale"] for s in steps], "losses": [s["loss"] for s in steps]})
    assert start["precision"] == "fp16-mixed" and start["loss_scale"] == 2.0**16
    assert [s["step"] for s in steps if s["skipped"]] == [4]
    assert steps[-1]["loss_scale"] == 2.0**15 and falls(steps)


def test_float8_tiny_run(run_dir: Path, report: dict[str, Any]) -> None:
    ok, why = has_float8()
    if not ok:
        pytest.skip(why)
    folder = run_dir / "tiny-fp8"
    plan = tiny_plan(folder, "fp8-tensorwise", 20, True)
    metrics = engine(plan)
    start, steps = events(metrics, "start")[-1], events(metrics, "step")
    record(report, "tiny_fp8", {"float8": start["float8"], "losses": [steps[0]["loss"], steps[-1]["loss"]]})
    assert start["float8"]["float8_layers"] == 4 * 7, start["float8"]  # q k v o gate up down per layer
    assert falls(steps)


def test_bench_net_nccl_on_all_local_gpus(run_dir: Path, report: dict[str, Any]) -> None:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"bench-net needs 2+ GPUs in one node (this machine: {n})")
    out = run_dir / "bench-net.json"
    run(["-m", "llmctl", "bench-net", "--nproc-per-node", str(n), "--sizes", "1MiB..256MiB", "-o", str(out)], 600)
    rep = json.loads(out.read_text())
    ar = [r for r in rep["results"] if r["collective"] == "all_reduce"][0]
    record(report, "bench_net_all_reduce_busbw_gbytes_s", [p["busbw_gbytes_s"] for p in ar["points"]])
    assert max(p["busbw_gbytes_s"] for p in ar["points"]) > 10


def test_fsdp_by_tp_on_two_gpus(run_dir: Path, report: dict[str, Any]) -> None:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"FSDP x TP needs 2+ GPUs (this machine: {n})")
    folder = run_dir / "tiny-tp"
    plan = tiny_plan(folder, "bf16-mixed", 20, False)
    data = yaml.safe_load(plan.read_text())
    data["hardware"]["nproc_per_node"] = n
    data["parallel"]["tp"] = 2
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    run(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "-m", "llmctl.engine", str(plan)], 600)
    steps = events(folder / "logs" / "metrics.jsonl", "step")
    record(report, "tiny_fsdp_tp", {"losses": [steps[0]["loss"], steps[-1]["loss"]]})
    assert falls(steps)


SPLIT = {
    # id: (model, sequence length, micro-batch, optimizer steps (global batch 8 sequences), more plan flags)
    "1b-2k": (BIG, SEQ, 8, ()),
    "1b-8k": (BIG, 8192, 2, ()),
    "3b-2k": ("llama-3.2-3b", SEQ, 2, ()),
    "3b-2k-lora": ("llama-3.2-3b", SEQ, 4, ("--finetune", "lora")),
}


@pytest.mark.parametrize("name", list(SPLIT))
def test_step_split_against_the_plan(name: str, run_dir: Path, report: dict[str, Any]) -> None:
    """GPU time by kind of kernel (llmctl.engine.kernel_profile, steps 4-5 under torch.profiler) against the plan's
    predicted step split for the same setup (`llmctl plan --json`, chosen.step_split_s): recorded per kind."""
    if not has_bf16():
        pytest.skip(f"bf16 needs compute capability 8.0+ (this GPU: {capability()})")
    model, seq, mb, more = SPLIT[name]
    folder = run_dir / f"split-{name}"
    pins = ("--micro-batch", str(mb), "--checkpointing", "none", "--precision", "bf16-mixed", *more)
    plan = big_plan(folder, *pins, steps=6, model=model, seq=seq)
    predicted = json.loads(
        run(
            ["-m", "llmctl", "plan", model, "--gpu", gpu_kind(), "--gpus", "1", "--seq-len", str(seq)]
            + ["--global-batch", "8", "--attention", attention(), "--json", "--no-write", *pins],
            300,
        ).stdout
    )["chosen"]
    metrics = engine(plan, extra_env={"LLMCTL_PROFILE_STEPS": "4:5"})
    steps, start = events(metrics, "step"), events(metrics, "start")[-1]
    prof = json.loads((folder / "kernel_profile.json").read_text())
    got = {
        "setup": f"{model} at {seq} tokens, mb {mb}, {' '.join(more) or 'full'}",
        "measured_s": prof["gpu_s_per_step"],
        "measured_wall_s": prof["wall_s_per_step"],
        "predicted_s": predicted["step_split_s"],
        "predicted_step_s": predicted["step_time_s"],
        "step_time_s_logged": [s.get("step_time_s") for s in steps[-2:]],
        "top_kernels": prof["top_kernels"][:12],
    }
    record(report, f"split/{name}", got)
    assert prof["gpu_s_per_step"].get("matmul", 0) > 0 and prof["gpu_s_per_step"].get("attention", 0) > 0
    # the attention kernels the profile saw are those of the kernel the start event says SDPA runs
    marks = {"cudnn": "cudnn", "fa2": "flash", "efficient": "fmha"}
    attn = [k["name"] for k in prof["top_kernels"] if k["kind"] == "attention"]
    assert attn and all(marks[start["sdpa"]["runs"]] in n for n in attn), (start["sdpa"], attn)
