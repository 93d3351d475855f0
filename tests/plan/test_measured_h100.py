"""The memory estimate against what an H100 measured (docs/measurements/h100-gpu-tier.json: the GPU tier's runs of
Llama-3.2-1B through the engine, peak allocated bytes per phase from the caching allocator).

Five setups: micro-batch 8 with no, full, and full checkpointing with a chunked loss (one micro-batch a step: no
gradients live in the forward), micro-batch 4 selective (2 micro-batches) and micro-batch 2 without checkpointing (4
micro-batches). The estimate's peak allocated must be within 2% of each, and its forward phase within 5% (the
engine's forward mark is read when the loss is computed, the estimate's forward is the same moment)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmctl.plan import memory as mem
from llmctl.spec import models
from llmctl.spec.setup import TrainSetup
from tests.plan.requests import plan_request

MEASURED = json.loads((Path(__file__).resolve().parents[2] / "docs/measurements/h100-gpu-tier.json").read_text())

SETUPS = {
    # name: (micro-batch, grad accumulation, checkpointing, loss chunk), as the tier's plans had them
    "mb8-none": (8, 1, "none", 0),
    "mb8-full": (8, 1, "full", 0),
    "mb8-full-chunk4k": (8, 1, "full", 4096),
    "mb4-selective": (4, 2, "selective", 0),
    "mb2-none": (2, 4, "none", 0),
}


def estimate(mb: int, acc: int, ck: str, chunk: int) -> mem.MemoryEstimate:
    setup = TrainSetup(
        precision="bf16-mixed",
        nodes=1,
        gpus_per_node=1,
        micro_batch_size=mb,
        grad_accum_steps=acc,
        seq_len=2048,
        checkpointing=ck,
        attention="sdpa",
        loss_chunk_tokens=chunk,
    )
    return mem.estimate(models.resolve_model("llama-3.2-1b"), setup)


@pytest.mark.parametrize("name", list(SETUPS))
def test_peak_allocated_within_2_percent_of_the_h100(name: str) -> None:
    got = MEASURED["results"][f"memory/{name}"]
    est = estimate(*SETUPS[name])
    gib = 2**30
    assert est.peak_allocated_bytes / gib == pytest.approx(got["peak_allocated_gib"], rel=0.02)
    assert est.phase_bytes["forward"] / gib == pytest.approx(got["phases_gib"]["forward"], rel=0.05)
    # The optimizer phase: the states alone (and foreach temporaries), measured 18.48 GiB.
    assert est.phase_bytes["optimizer"] / gib == pytest.approx(got["phases_gib"]["optimizer"], rel=0.02)


def test_with_one_micro_batch_no_gradient_lives_before_the_backward() -> None:
    one, two = estimate(8, 1, "full", 0), estimate(8, 2, "full", 0)
    grads = next(c for c in one.components if c.name.startswith("gradients"))
    assert grads.phases == ("backward", "optimizer")
    assert one.phase_bytes["forward"] + grads.bytes == two.phase_bytes["forward"]
    assert one.phase_bytes["loss_backward"] + grads.bytes == two.phase_bytes["loss_backward"]
    assert one.phase_bytes["backward"] == two.phase_bytes["backward"]


def test_the_loss_and_the_layers_backward_are_separate_moments() -> None:
    est = estimate(8, 1, "full", 0)
    where = {c.name: c.phases for c in est.components}
    assert where["loss backward buffers"] == ("loss_backward",)
    assert where["loss log-softmax (fp32, b*s*V)"] == ("forward", "loss_backward")
    assert where["recomputed block (backward)"] == ("backward",)
    assert "loss_backward" in where["activations (block inputs, checkpointed)"]
    assert est.peak_allocated_bytes == max(est.phase_bytes.values())
    assert sum(c.bytes for c in est.components if "loss_backward" in c.phases) == est.phase_bytes["loss_backward"]


def test_the_zero_engine_keeps_its_gradient_buffers() -> None:
    setup = TrainSetup(precision="bf16-mixed", nodes=1, gpus_per_node=8, micro_batch_size=2, engine="zero")
    est = mem.estimate(models.resolve_model("llama-3.2-1b"), setup)
    grads = next(c for c in est.components if c.name.startswith("gradients"))
    assert "forward" in grads.phases and "loss_backward" in grads.phases


def test_one_rank_holds_the_root_and_two_layers_in_the_compute_dtype() -> None:
    est = estimate(8, 1, "none", 0)
    spec = models.resolve_model("llama-3.2-1b")
    by = {c.name: c.bytes for c in est.components}
    assert by["unsharded root module (embeddings, LM head)"] == 2 * (spec.embedding_params + spec.head_params)
    assert by["unsharded layers (FSDP2 on one rank)"] == 2 * 2 * spec.params_per_layer
    pure = mem.estimate(spec, TrainSetup(precision="fp32", nodes=1, gpus_per_node=1, micro_batch_size=1))
    assert not any(c.name.startswith("unsharded") for c in pure.components)  # one rank, pure: no FSDP2


def test_the_float8_caveat_quotes_the_measured_runs() -> None:
    """The plan's float8 caveat (llmctl.plan.float8.MEASURED_H100) holds the ratios the H100 measured."""
    from llmctl.plan import float8 as f8

    runs = MEASURED["results"]
    pairs = [("speed/fp8-tensorwise", "speed/bf16-mixed"), ("speed/3b-fp8-tensorwise", "speed/3b-bf16-mixed")]
    for (_, got, want), (fp8, bf16) in zip(f8.MEASURED_H100, pairs):
        assert got == pytest.approx(runs[fp8]["tokens_per_s"] / runs[bf16]["tokens_per_s"], rel=1e-3)
        # the planner's prediction for the same setups, as it is now (predicted_run: measured / predicted)
        r8, _, g8 = predicted_run(fp8)
        r16, _, g16 = predicted_run(bf16)
        assert want == pytest.approx((g8["tokens_per_s"] / r8) / (g16["tokens_per_s"] / r16), rel=1e-3)
        assert got < want < 1.2  # the model still promises a little more than ran


# --- speed: the plan's step time against the engine's (the same setups, pinned) -----------------------------------
SPEEDS = {
    # result key: (model, tokens, precision, finetune)
    "speed/bf16-mixed": ("llama-3.2-1b", 2048, "bf16-mixed", "full"),
    "speed/fp8-tensorwise": ("llama-3.2-1b", 2048, "fp8-tensorwise", "full"),
    "speed/1b-8k-bf16-mixed": ("llama-3.2-1b", 8192, "bf16-mixed", "full"),
    "speed/1b-32k-bf16-mixed": ("llama-3.2-1b", 32768, "bf16-mixed", "full"),
    "speed/3b-bf16-mixed": ("llama-3.2-3b", 2048, "bf16-mixed", "full"),
    "speed/3b-fp8-tensorwise": ("llama-3.2-3b", 2048, "fp8-tensorwise", "full"),
    "speed/1b-lora-bf16-mixed": ("llama-3.2-1b", 2048, "bf16-mixed", "lora"),
    "speed/3b-lora-bf16-mixed": ("llama-3.2-3b", 2048, "bf16-mixed", "lora"),
}


def predicted_run(key: str, measured: dict | None = None, gpu: str = "H100-SXM") -> tuple[float, dict, dict]:
    """(measured / predicted tokens/s, the predicted split, the measured record) for a tier run, its setup pinned as
    the run had it (one GPU, global batch 8 sequences, SDPA); MEASURED (the H100's) unless another tier report is
    given, with its catalog GPU."""
    import re

    from llmctl.plan import comm as cm
    from llmctl.plan.timing import evaluate
    from llmctl.spec.finetune import Finetune
    from llmctl.spec.hardware import resolve_gpu

    got = (measured or MEASURED)["results"][key]
    model, seq, precision, method = SPEEDS.get(key) or SPLITS[key]
    m = re.match(r"mb (\d+)x(\d+), (\w+), (\w+), compile (\w+)", got.get("setup", ""))
    mb, acc, ck, attn, comp = (
        (int(m[1]), int(m[2]), m[3], m[4], m[5] == "True") if m else (*SPLIT_MB[key], "sdpa", True)
    )
    ft = Finetune(method) if method != "full" else Finetune()
    req = plan_request(
        spec=models.resolve_model(model),
        gpu=resolve_gpu(gpu),
        nodes=1,
        gpus_per_node=1,
        network=cm.Network(360.0, 50.0),
        seq_len=seq,
        global_batch_seqs=8,
        precision=precision,
        finetune=ft,
    )
    setup = TrainSetup(
        precision=precision,
        gpus_per_node=1,
        micro_batch_size=mb,
        grad_accum_steps=acc,
        seq_len=seq,
        checkpointing=ck,
        attention=attn,
        compile=comp,
        finetune=ft,
    )
    p = evaluate(req, setup).predicted
    measured_tps = got.get("tokens_per_s") or 8 * seq / got["measured_wall_s"]
    return measured_tps / p.tokens_per_s, p.split, got


@pytest.mark.parametrize("key", [k for k in SPEEDS if "lora" not in k])
def test_full_training_tokens_per_s_within_15_percent_of_the_h100(key: str) -> None:
    """Kernel tables and byte counts, none fitted to these runs: 1B and 3B, 2k to 32k tokens, bf16 and float8
    (measured / predicted 0.88-1.08 when this was written; one efficiency for every kernel gave 0.54-1.23)."""
    ratio, _, _ = predicted_run(key)
    assert 0.85 < ratio < 1.15, ratio


@pytest.mark.parametrize("key", [k for k in SPEEDS if "lora" in k])
def test_lora_is_over_predicted_where_the_run_is_launch_bound(key: str) -> None:
    """The planner prices GPU work; the LoRA runs left the H100 idle part of each step (3B: 0.59 s of GPU time in a
    0.98 s step, split/3b-2k-lora), which it does not model: it over-predicts them, by 16-30% here. Stated, and held
    to that band so that a change in either direction is seen. These runs had FSDP2 on their one rank; the engine now
    runs adapters on one rank without it (llmctl.spec.setup.fsdp_wraps), and the planner prices no FSDP2 copies for
    them: the copies those runs spent (about 0.02 s of the 1B step) widen the gap until a GPU measures again."""
    ratio, _, _ = predicted_run(key)
    assert 0.55 < ratio < 0.85, ratio


SPLITS = {
    "split/1b-2k": ("llama-3.2-1b", 2048, "bf16-mixed", "full"),
    "split/1b-8k": ("llama-3.2-1b", 8192, "bf16-mixed", "full"),
    "split/3b-2k": ("llama-3.2-3b", 2048, "bf16-mixed", "full"),
}
SPLIT_MB = {"split/1b-2k": (8, 1, "none"), "split/1b-8k": (2, 4, "none"), "split/3b-2k": (2, 4, "none")}


@pytest.mark.parametrize("key", list(SPLITS))
def test_step_split_by_kind_against_the_h100_profile(key: str) -> None:
    """GPU seconds per step by kind of kernel (torch.profiler, llmctl.engine.kernel_profile) against the predicted
    split: matmuls within 15%, attention within 25% (SDPA ran cuDNN's kernel, as kernels.kernel_for says), the
    memory-bound ops with FSDP's copies and the optimizer within 30% of the profile's elementwise, copy and
    optimizer kernels."""
    _, split, got = predicted_run(key)
    m = got["measured_s"]
    assert split["matmul"] == pytest.approx(m["matmul"], rel=0.15)
    assert split["attention"] == pytest.approx(m["attention"], rel=0.25)
    rest = m["memory"] + m.get("copy", 0) + m.get("optimizer", 0)
    assert split["memory"] + split["framework"] == pytest.approx(rest, rel=0.30)
    assert all("cudnn" in k["name"] for k in got["top_kernels"] if k["kind"] == "attention")
