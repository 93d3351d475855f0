"""Expert parallelism in the engine (llmctl.engine.experts): every MoE family with top-k routing trains 5 steps with
its routed experts split over ep ranks (dispatch and combine all-to-all, grouped GEMMs) exactly as FSDP2 over 4 ranks
with the same global batch (fp32: losses, gradient norms and every parameter's whole gradient after the first
backward within 1e-5, the experts' included); with FSDP over the rest (efsdp 2), none (ep 4), replicas (HSDP) and
context parallelism. The cases join the one 4-rank torchrun of tests/engine/parallel_runs.py."""

from __future__ import annotations

import pytest

from tests.engine.parallel_runs import EP_CASES, assert_trains_like_reference

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")


@pytest.mark.parametrize("case", list(EP_CASES))
def test_ep_trains_like_data_parallel(parallel_cases: dict, case: str) -> None:
    ref, ep = parallel_cases[case]
    assert_trains_like_reference(ref, ep)
    # the experts dispatched (every MoE layer's module on every rank), the reference's did not
    moe_layers = {"qwen3_moe": 1, "mixtral": 2, "deepseek_v3": 1, "gpt_oss": 2}[EP_CASES[case]["family"]]
    assert [r["dispatching"] for r in ep["state_bytes"]] == [moe_layers] * 4
    assert all(r["dispatching"] == 0 for r in ref["state_bytes"])


def test_each_rank_holds_its_share_of_the_experts(parallel_cases: dict) -> None:
    """At ep 2 x efsdp 2 and ep 4 x efsdp 1 a rank holds a quarter of the experts' bytes, as FSDP over 4 does; under
    HSDP (2 replicas of 2) ep 2 leaves each replica's ranks half the experts each, where FSDP's shard group of 2 holds
    half too: the experts' bytes summed over the ranks of one replica are the whole experts once."""
    ref, ep2 = parallel_cases["qwen3_moe-ep2"]
    _, ep4 = parallel_cases["qwen3_moe-ep4"]
    _, hsdp = parallel_cases["qwen3_moe-hsdp-ep2"]
    whole = sum(r["expert_parameters"] for r in ref["state_bytes"])
    assert whole > 0
    for run in (ep2, ep4):
        assert [r["expert_parameters"] for r in run["state_bytes"]] == [whole // 4] * 4
    assert [r["expert_parameters"] for r in hsdp["state_bytes"]] == [whole // 2] * 4
