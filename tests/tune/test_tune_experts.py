"""`llmctl tune` on a plan with expert parallelism (llmctl.tune.space): the trials keep the plan's ep and leave out the
strategies whose shard ranks it cannot borrow from (no_shard at ep > 1), instead of refusing the plan."""

from __future__ import annotations

from llmctl.plan import comm as cm
from llmctl.plan.emit import to_plan
from llmctl.plan.planner import plan as make_plan
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from llmctl.tune import space as tune_space
from tests.plan.requests import plan_request

QWEN = resolve_model("qwen3-30b-a3b")
H100 = resolve_gpu("H100-SXM")


def test_an_ep_plan_is_tuned_at_its_ep() -> None:
    req = plan_request(
        spec=QWEN, gpu=H100, nodes=1, gpus_per_node=8, network=cm.Network(360.0, None), seq_len=2048, ep=4
    )
    plan = to_plan(make_plan(req))
    base = plan.setup
    assert base.ep == 4
    s = tune_space.space_for(base, QWEN, compile_=True)
    assert "no_shard" in s.strategies
    setups = s.setups()
    assert setups and all(x.ep == 4 for x in setups)
    assert {x.strategy for x in setups} == {"full_shard"}  # no_shard has no shard ranks for ep 4 to borrow
    assert {x.tokens_per_step for x in setups} == {base.tokens_per_step}
    pool = tune_space.make_pool(tune_space.request_for_plan(plan, QWEN, H100), s, H100.name, first=base)
    assert pool.ranked and pool.ranked[0].setup.ep == 4
