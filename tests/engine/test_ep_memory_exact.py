"""The memory model at ep > 1 against the engine's per-rank bytes (issue 45's proof: "per-rank expert bytes equal the
estimate, ratio 1.00"): every expert-parallel case of the one 4-rank torchrun (tests/engine/parallel_runs.py EP_CASES:
ep 2 x efsdp 2, ep 4, HSDP, cp, Mixtral, DeepSeek-V3, gpt-oss's biases) measures each rank's routed-expert bytes after
the first step; llmctl.plan.memory.experts predicts them from the plan alone."""

from __future__ import annotations

import pytest

from llmctl.plan import memory as mem
from llmctl.plan.memory import experts as ex
from tests.engine.parallel_runs import EP_CASES

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.engine.model import model_spec_for  # noqa: E402
from llmctl.spec.planfile import load_plan  # noqa: E402


@pytest.mark.parametrize("case", list(EP_CASES))
def test_expert_bytes_per_rank_equal_the_estimate(parallel_cases: dict, case: str) -> None:
    _, ep = parallel_cases[case]
    _, path = parallel_cases["_plans"][case]
    plan = load_plan(str(path))
    spec, setup = model_spec_for(plan.model), plan.setup
    assert setup.ep > 1
    share = ex.expert_fraction(setup, setup.dims.fsdp_shard)
    predicted = ex.held_expert_params(spec, setup) * setup.precision.param_bytes * share
    measured = [r["expert_parameters"] for r in ep["state_bytes"]]
    assert [m / predicted for m in measured] == [1.0] * len(measured)  # ratio 1.00 on every rank
    # the whole states, every rank: parameters, gradients, optimizer states exactly the estimate's lines
    comps = mem.estimate(spec, setup).components
    lines = [
        next(c.bytes for c in comps if c.name.startswith(n)) for n in ("parameters", "gradients", "optimizer states")
    ]
    for r in ep["state_bytes"]:
        assert [r["parameters"], r["gradients"], r["optimizer"]] == lines
