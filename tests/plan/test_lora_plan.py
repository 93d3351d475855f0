"""LoRA / QLoRA in the cost model and the planner: FLOPs, MFU's convention, FSDP's traffic, the NF4 dequantization,
the search (tp 1, no offload) and the explanation that compares full, LoRA and QLoRA (issue 29)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan import flops as fl
from llmctl.plan import planner as pl
from llmctl.plan.emit import to_plan
from llmctl.plan.explain_finetune import compare_methods
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import evaluate
from llmctl.spec import planfile as pf
from llmctl.spec.finetune import Finetune, adapter_params
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
NET = cm.Network(H100.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, 8 * 400 / 8)
L7B = resolve_model("llama-2-7b")
L8B = resolve_model("llama-3.1-8b")
LORA = Finetune("lora", 16)


def request(spec=L8B, finetune=LORA, gpus=8, **kw) -> PlanRequest:
    return plan_request(spec=spec, gpu=H100, nodes=1, gpus_per_node=gpus, network=NET, finetune=finetune, **kw)


def test_lora_flops_are_about_two_thirds_of_full_plus_attention():
    s = 4096
    n, attn = fl.matmul_params(L7B), fl.attention_flops_per_token(L7B, s)
    p = adapter_params(L7B, LORA)
    full = sum(fl.method_flops_per_token(L7B, s))
    lora = sum(fl.method_flops_per_token(L7B, s, LORA))
    assert full == fl.model_flops_per_token(L7B, s) == 6 * n + attn
    # frozen base: forward + input gradients (4N); adapters: 6 x their parameters; attention unchanged
    assert lora == 4 * n + 6 * p + attn
    ratio = lora / full
    assert 2 / 3 < ratio < 2 / 3 + attn / full  # attention's share does not shrink
    fwd, bwd = fl.method_flops_per_token(L7B, s, LORA)
    assert fwd == 2 * n + 2 * p + attn // 3 and bwd == 2 * n + 4 * p + attn - attn // 3


def test_mfu_full_unchanged_and_lora_counts_the_methods_flops():
    full = fl.mfu(L8B, 4096, 1000.0, 989.5)
    assert (
        full
        == fl.mfu(L8B, 4096, 1000.0, 989.5, Finetune())
        == pytest.approx(
            (fl.model_flops_per_token(L8B, 4096) - fl.attention_flops_per_token(L8B, 4096) // 2) / 1e9 / 989.5
        )
    )
    assert fl.mfu(L8B, 4096, 1000.0, 989.5, LORA) < full


def test_fsdp_reduce_scatters_only_the_adapters():
    req = request()
    setup = req.candidate()
    lora = {o.name: o for o in evaluate(req, setup).predicted.comm_ops}
    full = {o.name: o for o in evaluate(req, replace(setup, finetune=Finetune())).predicted.comm_ops}
    per_layer = adapter_params(L8B, LORA) / L8B.num_layers
    assert lora["reduce-scatter"].bytes_per_call == pytest.approx(4 * per_layer)
    assert full["reduce-scatter"].bytes_per_call == pytest.approx(4 * L8B.params / L8B.num_layers)
    # the frozen layer is all-gathered as in full training (bf16), with its adapters
    gathered = lora["all-gather (forward)"].bytes_per_call
    assert gathered == pytest.approx(full["all-gather (forward)"].bytes_per_call + 2 * per_layer)


def test_lora_step_is_faster_and_qlora_pays_the_dequantization():
    req = request()
    setup = req.candidate(micro_batch_size=2, checkpointing="full")
    full = evaluate(req, replace(setup, finetune=Finetune())).predicted
    lora = evaluate(req, setup).predicted
    qlora = evaluate(req, replace(setup, finetune=Finetune("qlora"))).predicted
    # full checkpointing re-runs the forward (2N) in both: the matmuls (4N + 2N) / (6N + 2N) = 3/4 of full training's;
    # the adapters' own arithmetic (scale, add, their input gradients) is memory-bound and adds bytes; attention and
    # its recompute are the same.
    assert 0.74 < lora.split["matmul"] / full.split["matmul"] < 0.76
    assert lora.split["memory"] > full.split["memory"] and lora.split["attention"] == full.split["attention"]
    assert lora.compute_s < full.compute_s
    assert qlora.compute_s > lora.compute_s
    # NF4 read (0.516 B) + bf16 written per block weight, forward, backward and the full recompute: 3 passes
    from llmctl.plan.memory.adapters import NF4_BYTES_PER_WEIGHT, quantized_params
    from llmctl.plan.request import HBM_EFFICIENCY

    dequant = 3 * quantized_params(L8B) * (NF4_BYTES_PER_WEIGHT + 2) / (H100.hbm_gbytes_s * 1e9 * HBM_EFFICIENCY)
    assert qlora.compute_s - lora.compute_s == pytest.approx(dequant, rel=0.02)


def test_planner_searches_tp_1_only_and_explains_the_methods():
    req = request(spec=resolve_model("llama-3.1-70b"))
    t0 = time.perf_counter()
    result = pl.plan(req)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10  # the comparison is a few estimates, not a search per method
    assert result.chosen.setup.tp == 1 and result.chosen.setup.finetune == LORA
    assert all(c.setup.tp == 1 and not c.setup.levers.offload for c in result.candidates)
    text = result.finetune_choice
    assert text.startswith("full: fits on ") and "; lora r16: fits on " in text and "; qlora r16: fits on " in text
    assert "full: fits on 24 H100-SXM; does not fit on 8 GPUs" in text  # 70B full training needs 3 nodes
    outcomes = {o.method: o for o in compare_methods(req, result.chosen)}
    assert outcomes["full"].tokens_per_s is None
    assert outcomes["lora"].tokens_per_s == pytest.approx(result.chosen.predicted.tokens_per_s)
    assert outcomes["qlora"].min_gpus <= outcomes["lora"].min_gpus < outcomes["full"].min_gpus
    assert "finetune_choice" in result.as_dict(3)


def test_plan_file_has_the_finetune_section():
    result = pl.plan(request(spec=resolve_model("llama-3.2-1b"), finetune=Finetune("lora", 8, 16.0)))
    plan = to_plan(result)
    text = pf.plan_to_yaml(plan)
    assert "finetune:\n  method: lora\n  lora_rank: 8\n  lora_alpha: 16.0\n" in text
    assert plan.setup.finetune == Finetune("lora", 8, 16.0)
    full = pf.plan_to_yaml(to_plan(pl.plan(request(spec=resolve_model("llama-3.2-1b"), finetune=Finetune()))))
    assert "finetune" not in full


def test_request_refuses_what_adapters_do_not_run_with():
    with pytest.raises(InputError, match="tensor parallelism"):
        request(tp=2)
    with pytest.raises(InputError, match="CPU offload"):
        request(offload=True)


def test_another_method_is_timed_with_selective_checkpointing_before_full():
    """70B QLoRA on 8 A100-80GB picks no checkpointing at micro-batch 1; LoRA does not fit that way. It is timed with
    selective checkpointing (the planner's usual pick), not straight with full recompute (a third slower)."""
    from dataclasses import replace

    from llmctl.plan.timing import evaluate
    from llmctl.spec.hardware import resolve_gpu

    req = plan_request(
        spec=resolve_model("llama-3.1-70b"),
        gpu=resolve_gpu("A100-80GB"),
        nodes=1,
        gpus_per_node=8,
        network=NET,
        finetune=Finetune("qlora", 16),
        seq_len=2048,
        global_batch_seqs=32,
        memory_margin=0.0,  # QLoRA without checkpointing fills the GPU past the default margin: the case needs it
    )
    chosen = pl.plan(req).chosen
    assert chosen.setup.checkpointing == "none"
    lora = {o.method: o for o in compare_methods(req, chosen)}["lora"]
    assert lora.how == "selective checkpointing", lora
    full_ckpt = replace(chosen.setup, finetune=Finetune("lora", 16), checkpointing="full")
    assert lora.tokens_per_s > 1.05 * evaluate(req, full_ckpt).predicted.tokens_per_s


def test_what_the_engine_cannot_run_is_refused_at_plan_time():
    """QLoRA on GPT-2 (Conv1D blocks: the engine's NF4 base runs F.linear only) and targets that match nothing are
    one line when planned, not after torchrun has started; another method's line says why it is not run."""
    gpt2 = resolve_model("gpt2-xl")
    with pytest.raises(InputError, match="qlora: gpt2-xl's block matmuls are Conv1D") as e:
        request(spec=gpt2, finetune=Finetune("qlora", 16))
    assert e.value.hint == "use --finetune lora"
    with pytest.raises(InputError, match="LoRA targets w9 match no linear") as e:
        request(finetune=Finetune("lora", 16, targets=("w9",)))
    assert "lora_targets" in (e.value.hint or "")
    req = request(spec=gpt2, finetune=Finetune("lora", 16))
    outcomes = {o.method: o for o in compare_methods(req, pl.plan(req).chosen)}
    assert "Conv1D" in outcomes["qlora"].why_not and outcomes["qlora"].tokens_per_s is None
    assert outcomes["lora"].tokens_per_s and not outcomes["lora"].why_not
