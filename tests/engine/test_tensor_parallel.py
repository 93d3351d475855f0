"""Tensor parallelism (with sequence parallelism) in the engine: every family with a plan trains 5 steps on FSDP2 2 x
TP 2 exactly as on FSDP2 over 4 ranks with the same global batch (fp32: losses and every gradient within 1e-5), and
each rank holds a quarter of the model's parameter, gradient and AdamW bytes (1/dp of the unsplit ones); DeepSeek-V3
also at tp 4 (dp 1: no FSDP, plain and DTensor parameters side by side). One 4-rank
torchrun of tests/engine/parallel_worker.py trains every pair (with the context-parallel cases: parallel_runs.py)."""

from __future__ import annotations

import pytest

from tests.engine.parallel_runs import assert_trains_like_reference
from tests.family_configs import tiny

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.errors import SpecError  # noqa: E402
from llmctl.families import REGISTRY  # noqa: E402

TP_FAMILIES = [mt for mt, f in REGISTRY.items() if f.tp_plan is not None]


@pytest.mark.parametrize("family", [*TP_FAMILIES, "llama-hsdp", "deepseek_v3-tp4"])
def test_tp_trains_like_data_parallel(parallel_cases: dict, family: str) -> None:
    ref, tp = parallel_cases[family]
    assert_trains_like_reference(ref, tp)


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp_ranks_hold_what_the_estimate_says(parallel_cases: dict, family: str, tmp_path_factory) -> None:
    """Every rank's bytes of parameters, gradients and AdamW states under FSDP2 2 x TP 2 equal estimate-memory's
    lines (norms and MoE blocks replicated over the tp group, the rest split), to 0.5%; and the reference's 4 ranks
    hold together the whole model once (so the TP run holds more only by what it replicates)."""
    from llmctl.engine.dryrun import estimated_lines
    from llmctl.engine.model import model_spec_for
    from llmctl.spec.planfile import load_plan

    ref, tp = parallel_cases[family]
    plan = load_plan(parallel_cases["_plans"][family][1])
    est = estimated_lines(model_spec_for(plan.model), plan.setup)
    for kind in ("parameters", "gradients", "optimizer"):
        for r, rank in enumerate(tp["state_bytes"]):
            assert abs(rank[kind] / est[kind] - 1) <= 0.005, (family, kind, r, rank[kind], est[kind])
    ref_plan = load_plan(parallel_cases["_plans"][family][0])
    whole = sum(r["parameters"] for r in ref["state_bytes"])
    assert abs(whole / (4 * estimated_lines(model_spec_for(ref_plan.model), ref_plan.setup)["parameters"]) - 1) <= 0.005


@pytest.mark.parametrize("family", [mt for mt, f in REGISTRY.items() if f.tp_plan is None])
def test_a_family_without_a_plan_is_refused_in_one_line(family: str) -> None:
    from llmctl.engine.tensor_parallel import apply_tp

    cfg = tiny(family)
    config = __import__("transformers").AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = __import__("transformers").AutoModelForCausalLM.from_config(config)
    with pytest.raises(SpecError) as e:
        apply_tp(model, None)
    assert "cannot use tensor parallelism" in e.value.message and "\n" not in e.value.message
