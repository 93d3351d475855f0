"""The fine-tuning method in the setup and the plan file (llmctl.spec.finetune): adapter counts, the family's default
targets, the plan file's `finetune:` section, and the refusals of what adapters do not run with (one line each)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.errors import InputError, LlmctlError
from llmctl.spec.finetune import Finetune, adapted_linears, adapter_params, targets_for, targets_problem
from llmctl.spec.models import from_hf_config, from_preset
from llmctl.spec.planfile import plan_from_dict, plan_to_yaml
from llmctl.spec.setup import MemoryLevers, TrainSetup


def test_llama_8b_rank_16_is_pefts_count() -> None:
    """peft's print_trainable_parameters for Llama-3.1-8B, r 16 on the seven projections: 41,943,040; by hand,
    32 blocks x 16 x (q 8192 + k 5120 + v 5120 + o 8192 + 3 x (4096 + 14336))."""
    spec = from_preset("llama-3.1-8b")
    assert adapter_params(spec, Finetune("lora", rank=16)) == 41_943_040
    assert adapter_params(spec, Finetune("lora", rank=8)) == 41_943_040 // 2
    assert adapter_params(spec, Finetune("full")) == 0
    only_qv = Finetune("lora", rank=16, targets=("q_proj", "v_proj"))
    assert adapter_params(spec, only_qv) == 32 * 16 * (8192 + 5120)


def test_family_targets() -> None:
    gpt2 = from_hf_config({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 300})
    assert targets_for(gpt2, Finetune("lora")) == ("c_attn", "c_proj", "c_fc")
    # GPT-2's Conv1D weights are (in, out): c_attn maps 64 -> 192
    assert ("attn.c_attn", 64, 192) in adapted_linears(gpt2, targets_for(gpt2, Finetune("lora")))
    mixtral = from_preset("mixtral-8x7b")
    names = {m.rsplit(".", 1)[-1] for m, _, _ in adapted_linears(mixtral, targets_for(mixtral, Finetune("lora")))}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}  # the routed experts are 3-D tensors, not linears
    assert targets_problem(mixtral, Finetune("lora", targets=("w1",))) is not None
    assert targets_problem(mixtral, Finetune("lora")) is None


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"method": "dora"}, "unknown fine-tuning method"),
        ({"method": "lora", "rank": 0}, "rank"),
        ({"method": "lora", "alpha": float("nan")}, "alpha"),
        ({"method": "lora", "dropout": 1.0}, "dropout"),
        ({"method": "lora", "targets": ("q proj",)}, "not a module name"),
    ],
)
def test_bad_finetune_values_are_one_line(kwargs: dict, words: str) -> None:
    with pytest.raises(LlmctlError, match=words):
        Finetune(**kwargs)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"tp": 2, "gpus_per_node": 2}, "tensor parallelism"),
        ({"engine": "zero"}, "zero engine"),
        ({"precision": "fp8"}, "fp8-tensorwise converts the frozen linears"),
        ({"levers": MemoryLevers(offload=True)}, "offload"),
    ],
)
def test_setups_adapters_do_not_run_with_are_refused(change: dict, words: str) -> None:
    TrainSetup(**change)  # the same setup trains fully
    with pytest.raises(InputError, match=words):
        TrainSetup(**change, finetune=Finetune("lora"))
    with pytest.raises(InputError, match="QLoRA computes in bf16"):
        TrainSetup(precision="fp32", finetune=Finetune("qlora"))


BASE = {"model": {"preset": "llama-3.1-8b"}, "training": {"max_steps": 10, "seq_len": 1024}}


def test_plan_file_round_trip_and_defaults() -> None:
    plan = plan_from_dict({**BASE, "finetune": {"method": "LoRA", "lora_rank": 8, "lora_targets": ["q_proj"]}})
    ft = plan.setup.finetune
    assert (ft.method, ft.rank, ft.alpha, ft.dropout, ft.targets) == ("lora", 8, 32.0, 0.0, ("q_proj",))
    text = plan_to_yaml(plan)
    assert "finetune:" in text and plan_from_dict(__import__("yaml").safe_load(text)).setup.finetune == ft
    again = plan.with_setup(replace(plan.setup, finetune=Finetune("lora", rank=32)))
    assert again.finetune.lora_rank == 32 and again.finetune.lora_targets is None
    full = plan_from_dict(BASE)
    assert full.setup.finetune == Finetune() and "finetune" not in plan_to_yaml(full)  # older plans read as before


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"method": "lora", "lora_rank": 0}, "finetune.lora_rank"),
        ({"method": "lora", "lora_targets": []}, "empty list"),
        ({"method": "lora", "lora_dropout": 1}, "finetune.lora_dropout"),
        ({"method": "adapters"}, "finetune.method"),
    ],
)
def test_bad_plan_sections_are_one_line(section: dict, words: str) -> None:
    with pytest.raises(LlmctlError, match=words) as e:
        plan_from_dict({**BASE, "finetune": section}, "p.yaml")
    assert "\n" not in str(e.value)


def test_plan_refuses_lora_with_tp_as_one_line() -> None:
    doc = {**BASE, "finetune": {"method": "lora"}, "parallel": {"tp": 2}, "hardware": {"nproc_per_node": 2}}
    with pytest.raises(LlmctlError, match=r"p.yaml: finetune.method: lora: tensor parallelism \(tp 2\)"):
        plan_from_dict(doc, "p.yaml")
