"""The planner's expert-parallel search (llmctl.plan.space.ep_degrees, family_eps; llmctl.plan.search): ep only for
MoE models, only where it divides the experts and the ranks it borrows, only at tp 1 for llmctl's engine; a pin is
kept; the choice is explained and written to the plan file."""

from __future__ import annotations

import pytest

from llmctl.plan import comm as cm
from llmctl.plan import emit
from llmctl.plan.planner import plan
from llmctl.plan.space import Choice, ep_degrees, ep_placement_problem, family_eps
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from llmctl.spec.planfile import plan_to_yaml
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
QWEN = resolve_model("qwen3-30b-a3b")  # 128 routed experts
MIXTRAL = resolve_model("mixtral-8x7b")  # 8 routed experts
L8B = resolve_model("llama-3.1-8b")
NET = cm.Network(intra_gbytes_s=360.0, inter_node_gbytes_s=400.0)


def request(spec=QWEN, nodes: int = 1, **kw):
    args = dict(spec=spec, gpu=H100, nodes=nodes, gpus_per_node=8, network=NET, seq_len=2048)
    args.update(kw)
    return plan_request(**args)


def test_dense_models_search_ep_1_only():
    rejected: list[str] = []
    assert ep_degrees(request(L8B, nodes=4), rejected) == [1]
    assert rejected == []


def test_moe_searches_powers_of_two_dividing_the_experts():
    assert ep_degrees(request(QWEN, nodes=4), []) == [1, 2, 4, 8, 16, 32]  # up to the cluster's 32 GPUs
    assert ep_degrees(request(MIXTRAL, nodes=4), []) == [1, 2, 4, 8]  # 8 experts: no ep 16


def test_a_pin_is_the_only_degree():
    assert ep_degrees(request(QWEN, ep=4), []) == [4]


def test_families_take_the_degrees_that_divide_their_shard_ranks():
    req = request(QWEN, nodes=2)
    eps = ep_degrees(req, [])
    assert family_eps(req, Choice("full_shard", 2), eps, []) == [1, 2, 4, 8, 16]
    assert family_eps(req, Choice("hybrid_shard", 2), eps, []) == [1, 2, 4, 8]  # a node's 8 shard ranks
    assert family_eps(req, Choice("no_shard", 2), eps, []) == [1]  # no shard ranks to borrow
    assert family_eps(req, Choice("no_shard", 2, cp=4), eps, []) == [1, 2, 4]  # cp's ranks are borrowed too
    assert family_eps(req, Choice("full_shard", 2, tp=2), eps, []) == [1]  # the engine runs EP at tp 1
    assert family_eps(req, Choice("full_shard", 2, pp=2), eps, []) == [1]  # and not yet inside pipeline stages


def test_a_pin_a_family_cannot_take_is_said():
    req = request(QWEN, nodes=2, ep=8)
    rejected: list[str] = []
    assert family_eps(req, Choice("full_shard", 2, tp=2), [8], rejected) == []
    assert family_eps(req, Choice("no_shard", 2), [8], rejected) == []
    assert rejected == [
        "full_shard x TP 2 x EP 8 on 2 nodes: the engine's expert parallelism runs at tp 1 (experts are not split "
        "over tp; tp 2)",
        "no_shard x EP 8 on 2 nodes: ep 8 must divide the ranks it borrows from: dp_shard x cp = 1",
    ]


def test_groups_sit_evenly_on_the_nodes():
    assert ep_placement_problem(4, 8) is None and ep_placement_problem(16, 8) is None
    assert ep_placement_problem(4, 6) == "ep 4 groups would straddle nodes of 6 GPUs"


@pytest.fixture(scope="module")
def moe_plan():
    return plan(request(QWEN, nodes=1, global_batch_seqs=64))


def test_the_search_offers_ep_only_where_it_divides(moe_plan):
    seen = {(c.setup.dims.fsdp_shard, c.setup.tp, c.setup.ep) for c in moe_plan.variants}
    assert any(ep > 1 for _, _, ep in seen)
    for shard, tp, ep in seen:  # dp_shard x cp ranks borrowed (no_shard's only from cp)
        assert ep in (1, 2, 4, 8)
        assert ep == 1 or (tp == 1 and shard % ep == 0)


def test_moe_plan_chooses_ep_and_says_why(moe_plan):
    """On one node of 8 H100 the grouped GEMMs and the smaller expert gathers beat the expert loop by more than the
    all-to-alls cost (test_ep_cost has the terms)."""
    c = moe_plan.chosen
    assert c.setup.ep > 1
    assert moe_plan.ep_choice.startswith(f"EP {c.setup.ep}: experts ")
    assert "GiB per GPU instead of" in moe_plan.ep_choice and "its all-to-alls cost " in moe_plan.ep_choice
    assert "of the step" in moe_plan.ep_choice and "the best without EP" in moe_plan.ep_choice
    d = c.as_dict()
    assert d["ep"] == c.setup.ep and d["ep_alltoall_s"] > 0
    assert moe_plan.as_dict(top=3)["ep_choice"] == moe_plan.ep_choice
    written = emit.to_plan(moe_plan)
    assert written is not None and written.parallel.ep == c.setup.ep
    assert f"  ep: {c.setup.ep}\n" in plan_to_yaml(written)


def test_a_pinned_ep_is_kept():
    result = plan(request(QWEN, nodes=1, global_batch_seqs=64, ep=4))
    assert result.chosen.setup.ep == 4
    assert all(c.setup.ep == 4 for c in result.variants)


def test_dense_plans_carry_no_ep():
    result = plan(request(L8B, nodes=1, global_batch_seqs=64, tp=1, pp=1))
    assert result.ep_choice == ""
    assert "ep" not in result.chosen.as_dict()
    assert "ep_choice" not in result.as_dict(top=3)


@pytest.mark.parametrize(
    ("model", "nodes", "ep"),
    [("qwen3-235b-a22b", 8, 16), ("deepseek-v3", 32, 128)],
)
def test_the_issues_proof_plans_choose_ep_and_explain_it(model, nodes, ep):
    """Issue 45's proof: `llmctl plan qwen3-235b-a22b --gpu H100 --nodes 8 --gpus-per-node 8` and `plan deepseek-v3`
    on 32 x 8 H100 (3200 Gbit/s a node) choose EP and say why, with the experts per GPU and the all-to-alls' share of
    the step. Neither fits the GPUs without EP (the best without it offloads, or nothing fits). At the global batch
    the proof was stated at, the default then: 128 sequences, or one per GPU (the default in tokens, 3.4M for these
    sizes, spreads CPU offload's host step over more compute, and a setup with offload wins there)."""
    result = plan(request(resolve_model(model), nodes=nodes, global_batch_seqs=max(128, nodes * 8)))
    s = result.chosen.setup
    assert (s.ep, s.tp, s.pp, s.levers.offload) == (ep, 1, 1, False)
    text = result.ep_choice
    assert text.startswith(f"EP {ep}: experts ") and " GiB per GPU instead of " in text
    assert "of the step" in text and "no setup without EP fits" in text


def test_a_pipeline_bound_with_a_head_only_stage_does_not_divide_by_zero():
    """Qwen3-30B-A3B on exactly 4 x 8 H100: a pp degree whose heaviest rank holds no block (no attention share) left
    pipeline_bound's least share at 0 and its tokens/s a division by zero (`plan --compare` crashed on it)."""
    req = request(QWEN, nodes=4, network=cm.Network(240.0, 200.0), nodes_exact=True)
    assert plan(req).chosen.predicted.tokens_per_s > 0


def test_an_ep_pin_on_a_dense_model_is_one_line_exit_2(tmp_path) -> None:
    """`plan llama-3.1-8b --ep 2` was an internal error (the cost model looked for an MoE layer): the pin meets the
    model's ep rule first, one line, exit 2, no plan file written."""
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    out = tmp_path / "p.yaml"
    r = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--ep", "2", "-o", str(out)])
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("llmctl: error:")]
    assert len(errors) == 1 and "needs a mixture-of-experts model; llama-3.1-8b is dense" in errors[0], r.output
    assert "internal error" not in r.output and not out.exists()
