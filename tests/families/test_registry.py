"""The family registry: every analytical model_type is one entry with a reader, features, a decoder path and a tiny
config; the memory, FLOP and spec code read features, never a model_type."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from llmctl.families import ANALYTICAL_MODEL_TYPES, MODULES, REGISTRY, family_of
from llmctl.families.base import Features
from llmctl.plan import memory as mem
from llmctl.spec.models import from_hf_config
from llmctl.spec.setup import TrainSetup

ROOT = Path(__file__).resolve().parents[2] / "llmctl"


def test_fifteen_model_types_in_one_registry() -> None:
    assert len(ANALYTICAL_MODEL_TYPES) == 15
    assert sum(len(m.FAMILIES) for m in MODULES) == len(REGISTRY)  # no model_type declared twice
    assert family_of("granite") is None


@pytest.mark.parametrize("model_type", ANALYTICAL_MODEL_TYPES)
def test_each_family_carries_its_hooks(model_type: str) -> None:
    """Like torchtitan's TrainSpec: a reader, features, a tensor-parallel plan or the words of its refusal, and the
    pipeline split points (empty: the even split by layers)."""
    fam = REGISTRY[model_type]
    assert callable(fam.read) and isinstance(fam.features, Features)
    assert (fam.tp_plan is None) == bool(fam.tp_unsupported)
    assert fam.pipeline_split is None


@pytest.mark.parametrize("model_type", ANALYTICAL_MODEL_TYPES)
def test_each_tiny_config_reads_as_its_own_type(model_type: str) -> None:
    fam = REGISTRY[model_type]
    assert fam.tiny["model_type"] == model_type
    spec = from_hf_config(fam.tiny, name=f"tiny {model_type}", source="config")
    assert spec.family is fam and spec.features is fam.features
    assert spec.params > 0 and spec.vocab_size == 300
    est = mem.estimate(spec, TrainSetup(precision="fp32", seq_len=32, micro_batch_size=2, attention="eager"))
    assert est.device_bytes > 0


def test_features_change_the_estimate_where_the_family_differs() -> None:
    """A feature is read: the same blocks with Gemma's norms keep more than with Llama's, and an fp32 router keeps
    its input (so a mutant that ignores a feature fails here)."""
    from dataclasses import replace

    gemma = from_hf_config(REGISTRY["gemma2"].tiny, name="g", source="config")
    as_llama = replace(gemma, model_type="gemma2-as-llama")  # no family: default features
    setup = TrainSetup(precision="bf16-mixed", seq_len=32, micro_batch_size=2, attention="eager")
    assert mem.estimate(gemma, setup).phase_bytes["backward"] > mem.estimate(as_llama, setup).phase_bytes["backward"]
    ds = from_hf_config(REGISTRY["deepseek_v3"].tiny, name="d", source="config")
    terms = mem.block_activation_terms(ds, ds.layers[-1], 2, 32, 2, "sdpa")
    assert "moe router fp32 input" in terms
    assert Features().norm == "hf_rmsnorm" and REGISTRY["olmo2"].features.norm == "fp32_weight"


def test_the_models_read_features_not_model_types() -> None:
    """No comparison with a model_type outside the families' own modules."""
    pattern = re.compile(r"model_type\s*(==|!=|\bin\b|not in)")
    offenders = []
    for folder in ("plan", "spec", "engine"):
        for path in (ROOT / folder).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def test_what_a_tp_rank_holds_whole() -> None:
    """Under tensor parallelism every rank holds the norms whole and, for MLA, the shared latent projections (q_a,
    kv_a_proj_with_mqa: llmctl.families.tensor_parallel's `latent_attention`); q_b, kv_b, o and OLMo 2's q/k
    projections are split (their q/k norms, over all heads, are whole), gpt-oss's sinks split with the heads. The
    memory model reads the same rule: a rank's block parameters are (all - whole) / tp + whole."""
    from llmctl.families.tensor_parallel import replicated
    from llmctl.plan.memory.pipeline import tp_block_params

    whole = {
        mt: {n for n, _ in spec.layers[0].tensors(spec.hidden_size) if replicated(n)}
        for mt in ("deepseek_v3", "olmo2", "gpt_oss")
        for spec in [from_hf_config(REGISTRY[mt].tiny, name=mt, source="config")]
    }
    assert {n for n in whole["deepseek_v3"] if "proj" in n} == {
        "self_attn.q_a_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
    }
    assert {n for n in whole["olmo2"] if "self_attn" in n} == {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    assert not any("sinks" in n or "proj" in n for n in whole["gpt_oss"])
    ds = from_hf_config(REGISTRY["deepseek_v3"].tiny, name="d", source="config")
    layer = ds.layers[0]  # the dense first layer
    kept = sum(math.prod(s) for n, s in layer.tensors(ds.hidden_size) if replicated(n))
    setup = TrainSetup(precision="fp32", seq_len=32, micro_batch_size=2, tp=2, gpus_per_node=2)
    assert tp_block_params(ds, setup, layer) == (ds.params_of(layer) - kept) / 2 + kept
