"""`optimizer_states`: one field of the setup and of the plan file (`optimizer.states`), auto by default so that a plan
that does not ask reads and writes as before (torch-free)."""

from __future__ import annotations

import pytest

from llmctl.errors import InputError, SpecError
from llmctl.spec.optimizer_states import adam_8bit_bytes, caveat_note, quantized
from llmctl.spec.planfile import Plan, plan_from_dict, plan_to_yaml
from llmctl.spec.setup import TrainSetup

PLAN = {
    "name": "t",
    "model": {"preset": "llama-tiny"},
    "hardware": {"gpu": "A100-80GB", "nodes": 1, "nproc_per_node": 8},
    "training": {"precision": "bf16-mixed", "seq_len": 128, "max_steps": 3},
}


def test_auto_is_the_precisions_own_and_names_have_one_spelling() -> None:
    assert TrainSetup().optimizer_states == "auto" and TrainSetup().states_dtype == "fp32"
    assert TrainSetup(precision="bf16").states_dtype == "bf16"  # pure bf16 keeps bf16 moments, as always
    assert TrainSetup(precision="bf16", optimizer_states="fp32").states_dtype == "fp32"
    for spelling, name in (("INT8", "8bit"), ("8-bit", "8bit"), ("bfloat16", "bf16"), ("float32", "fp32")):
        assert TrainSetup(optimizer_states=spelling).optimizer_states == name


def test_bad_states_are_one_line() -> None:
    with pytest.raises(InputError, match=r"unknown optimizer states 'int4'") as e:
        TrainSetup(optimizer_states="int4")
    assert e.value.hint == "choose one of: auto, fp32, bf16, 8bit"
    with pytest.raises(InputError, match="optimizer states 8bit apply to adamw's two moments, not lion"):
        TrainSetup(optimizer="lion", optimizer_states="8bit")
    TrainSetup(optimizer="lion", optimizer_states="auto")  # the default asks nothing of any optimizer


def test_an_older_plan_reads_as_auto_and_writes_as_it_was() -> None:
    plan = plan_from_dict(PLAN)
    assert plan.optimizer.states == "auto" and plan.setup.optimizer_states == "auto"
    text = plan_to_yaml(plan)
    assert "states" not in text  # the plans written before (and the golden files) keep their text


def test_the_states_round_trip_through_the_plan_file() -> None:
    plan = plan_from_dict({**PLAN, "optimizer": {"states": "int8"}})
    assert plan.optimizer.states == "8bit" and plan.setup.optimizer_states == "8bit"
    text = plan_to_yaml(plan)
    assert "  states: 8bit\n" in text
    import yaml

    again = plan_from_dict(yaml.safe_load(text))
    assert again == plan and again.setup == plan.setup
    # with_setup (llmctl tune, launch --dry-start) writes the setup's states back, and the inverse holds.
    moved = plan.with_setup(TrainSetup(**{**_setup_kwargs(plan), "optimizer_states": "bf16"}))
    assert moved.optimizer.states == "bf16" and moved.setup.optimizer_states == "bf16"
    assert moved.optimizer.lr == plan.optimizer.lr  # the rest of the section as it was


def _setup_kwargs(plan: Plan) -> dict:
    s = plan.setup
    return {"precision": s.precision, "gpus_per_node": s.gpus_per_node, "seq_len": s.seq_len}


@pytest.mark.parametrize("value", ["int4", 8, None])
def test_a_bad_plan_value_is_one_line_naming_the_key(value) -> None:
    with pytest.raises(SpecError, match=r"^plan: optimizer\.states: ") as e:
        plan_from_dict({**PLAN, "optimizer": {"states": value}})
    assert "\n" not in str(e.value)


def test_torchaos_quantization_rule_and_bytes() -> None:
    """torchao/optim/adam.py _AdamBase._new_buffer: >= 4096 values and a whole number of 256-blocks."""
    assert quantized(4096) and quantized(4352) and not quantized(4095) and not quantized(4096 + 128)
    # codes (1 B a value) + one fp32 scale a block + a 256-entry fp32 code book, for each of the two moments.
    assert adam_8bit_bytes(65536, 4) == 2 * (65536 + 4 * 256 + 1024)
    assert adam_8bit_bytes(256, 4) == 2 * 256 * 4 and adam_8bit_bytes(256, 2) == 2 * 256 * 2  # the weights' dtype
    assert adam_8bit_bytes(0, 4) == 0  # a rank with no rows of a tensor


def test_the_caveat_is_said_only_when_asked_and_names_its_source() -> None:
    assert caveat_note("auto") is None and caveat_note("fp32") is None
    assert "https://arxiv.org/abs/2110.02861" in caveat_note("8bit")
    bf16 = caveat_note("bf16")
    assert "arXiv 2412.19437" in bf16 and "https://arxiv.org/abs/2010.06192" in bf16
