"""The engine's tokens-per-expert metrics (llmctl.engine.experts.load_fields): rows routed to each expert per step,
counted once per forward (not again in activation checkpointing's recompute), and a forced imbalance shows as one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.engine.experts import experts_modules, load_fields, watch_load  # noqa: E402
from tests.family_configs import tiny  # noqa: E402


def _model() -> torch.nn.Module:
    cfg = tiny("qwen3_moe")
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def test_rows_per_expert_counted_once_and_imbalance_shows() -> None:
    model = _model()
    assert watch_load(model) == 1  # one MoE layer (layer 0 is dense: mlp_only_layers)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.sum().backward()
    f = load_fields(model, steps=1, whole_world=False)
    # 32 tokens x top-2 = 64 rows over 4 experts, each counted once
    assert f["expert_tokens_mean"] == 16.0
    assert f["expert_tokens_min"] <= 16.0 <= f["expert_tokens_max"]
    assert f["expert_imbalance"] == f["expert_tokens_max"] / 16.0
    assert load_fields(model, steps=1, whole_world=False) == {}  # reset after reading

    # The same forward under activation checkpointing (its recompute runs the router and experts again in backward)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model(input_ids=ids).logits.sum().backward()
    assert load_fields(model, steps=2, whole_world=False)["expert_tokens_mean"] == 8.0  # 64 rows / 4 / 2 steps

    # Force every token's first choice to expert 0: its load is the 32 tokens' first choices plus its share of seconds
    gate = next(m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "weight"))
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[0].fill_(1.0)
    h = torch.ones(2, 16, 64)  # a positive hidden state: expert 0's logit is the largest for every token
    moe = next(m for m in model.modules() if experts_modules(m) and hasattr(m, "gate"))
    moe(h)
    f = load_fields(model, steps=1, whole_world=False)
    assert f["expert_tokens_max"] == 32.0 and f["expert_imbalance"] == 2.0  # 32 rows where the mean is 16


def test_a_dense_model_has_no_expert_fields() -> None:
    cfg = tiny("llama")
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert watch_load(model) == 0 and load_fields(model, steps=1, whole_world=False) == {}
