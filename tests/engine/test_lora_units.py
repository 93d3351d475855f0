"""LoRA's engine pieces in one process (llmctl.engine.lora): the build (peft's adapters injected, the base frozen in
the compute dtype, the adapters in the parameter dtype), the base's identity, and the refusals. The runs (training,
resume, export) are in tests/engine/test_weights_round_trip.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmctl.errors import InputError, SpecError
from llmctl.spec.finetune import Finetune, adapter_params
from llmctl.spec.planfile import plan_from_dict

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")
pytest.importorskip("peft", reason="needs peft (pip install 'llmctl[lora]')")

from llmctl.engine import lora  # noqa: E402
from llmctl.engine.materialize import clean_name  # noqa: E402
from llmctl.engine.model import build_meta_model, model_spec_for  # noqa: E402

OVERRIDES = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 172, "num_attention_heads": 4}


def _plan(precision: str = "bf16-mixed", **finetune: object) -> object:
    return plan_from_dict(
        {
            "model": {"preset": "llama-tiny", "overrides": OVERRIDES},
            "training": {"max_steps": 1, "seq_len": 32, "precision": precision},
            "finetune": {"method": "lora", "lora_rank": 4, **finetune},
        }
    )


def _build(plan: object) -> torch.nn.Module:
    """The engine's meta build of a plan's model (padded vocabulary, its setup's precision and adapters)."""
    return build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")


def test_build_freezes_the_base_in_the_compute_dtype_and_trains_fp32_adapters() -> None:
    plan = _plan()
    model = build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert all(p.dtype == torch.bfloat16 for p in frozen.values())
    assert sum(p.numel() for p in trainable.values()) == adapter_params(model_spec_for(plan.model), plan.setup.finetune)
    assert lora.trainable_params(model) == sum(p.numel() for p in trainable.values())
    # transformers' names stay; the frozen linear's name without peft's base_layer is the safetensors name
    name = "model.layers.0.self_attn.q_proj.base_layer.weight"
    assert name in frozen and clean_name(name) == "model.layers.0.self_attn.q_proj.weight"
    # only the named targets get adapters
    only_q = _build(_plan(lora_targets=["q_proj"]))
    assert {n.split(".")[-4] for n, p in only_q.named_parameters() if p.requires_grad} == {"q_proj"}


def test_pure_fp32_keeps_everything_fp32() -> None:
    model = _build(_plan("fp32"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_targets_that_match_nothing_are_one_line() -> None:
    with pytest.raises(SpecError, match="finetune.lora_targets: .*w9"):
        _build(_plan(lora_targets=["w9"]))


def test_a_missing_package_is_one_line_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    lora.check_installed(Finetune("qlora"))
    lora.check_installed(Finetune("lora"))
    lora.check_installed(Finetune())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "peft" else real(n, *a))
    with pytest.raises(InputError, match=r"finetune.method qlora needs the peft package.*llmctl\[lora\]"):
        lora.check_installed(Finetune("qlora"))
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    monkeypatch.setitem(sys.modules, "torchao.dtypes", None)
    with pytest.raises(InputError, match=r"qlora needs torchao .*llmctl\[qlora\]"):
        lora.check_installed(Finetune("qlora"))


def _folder(tmp: Path, data: bytes) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    (tmp / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    (tmp / "config.json").write_text('{"model_type": "llama"}')
    return tmp


def test_fingerprint_sees_the_data_the_header_and_the_config(tmp_path: Path) -> None:
    a = lora.fingerprint_folder(_folder(tmp_path / "a", bytes(16)))
    assert a == lora.fingerprint_folder(_folder(tmp_path / "b", bytes(16)))  # a copy is the same base
    assert a != lora.fingerprint_folder(_folder(tmp_path / "c", bytes(15) + b"\x01"))
    c = _folder(tmp_path / "d", bytes(16))
    (c / "config.json").write_text('{"model_type": "qwen2"}')
    assert a != lora.fingerprint_folder(c)


def test_random_base_identity_follows_config_and_seed() -> None:
    one, again = (lora.base_identity(p.model, p.training.seed, model_spec_for(p.model)) for p in (_plan(), _plan()))
    assert one == again and "seed 0" in one["base"]
    other = plan_from_dict(
        {
            "model": {"preset": "llama-tiny", "overrides": OVERRIDES},
            "training": {"max_steps": 1, "seq_len": 32, "seed": 1},
            "finetune": {"method": "lora"},
        }
    )
    assert (
        lora.base_identity(other.model, other.training.seed, model_spec_for(other.model))["fingerprint"]
        != one["fingerprint"]
    )


def test_check_base_refusals() -> None:
    cur = {"base": "weights /a", "fingerprint": "f1"}
    lora.check_base({"base": "weights /b", "fingerprint": "f1"}, cur, "x")  # moved, same files: fine
    with pytest.raises(
        SpecError, match="x holds adapters trained on weights /b .* not on this plan's base, weights /a"
    ):
        lora.check_base({"base": "weights /b", "fingerprint": "f2"}, cur, "x")
    with pytest.raises(SpecError, match="not saved by a LoRA run"):
        lora.check_base(None, cur, "x")
