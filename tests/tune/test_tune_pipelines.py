"""`llmctl tune` and pipeline parallelism (llmctl.tune.space): where the planner ranked pipelined setups, or the plan
runs one, the trials vary pp and the schedule too, at the plan's global batch, each trial testing one decision."""

from __future__ import annotations

from dataclasses import replace

from llmctl.engine.model import base_spec
from llmctl.plan.timing import Candidate, Prediction
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.planfile import plan_from_dict
from llmctl.tune import space as tune_space
from tests.engine.conftest import TINY, deep_update

A100 = "A100-80GB"
DATA = deep_update(TINY, {"hardware": {"gpu": A100}, "training": {"micro_batch_size": 2, "grad_accum_steps": 4}})


def _plan():
    plan = plan_from_dict(DATA)
    return plan, base_spec(plan.model)


def test_a_pipelined_plan_tries_its_other_schedules() -> None:
    plan, spec = _plan()
    base = replace(plan.setup, pp=2, micro_batch_size=1, grad_accum_steps=16)  # 2 ranks: pp 2, one dp rank
    pipes = tune_space.schedule_variants(base, spec)
    assert pipes == ((2, "1f1b", None), (2, "interleaved-1f1b", 2), (2, "zbv", None))  # 2 layers + 2: 4 stages
    s = tune_space.space_for(base, spec, pipelines=pipes, compile_=False, strategies=["full_shard"])
    found = {tune_space.pipeline_of(x) for x in s.setups()}
    assert found == set(pipes)
    assert {x.tokens_per_step for x in s.setups()} == {base.tokens_per_step}  # the global batch held
    assert tune_space.schedule_variants(plan.setup, spec) == ()  # no pipeline: nothing to vary


def test_the_planners_pipelines_join_the_trials_one_decision_at_a_time() -> None:
    plan, spec = _plan()
    gpu = resolve_gpu(A100)
    req = tune_space.request_for_plan(plan, spec, gpu)
    zero = Prediction(0.0, 0.0, 0.0, 0.0, 1.0, 1, 1.0, 1.0, 0.0, 0, "")
    ranked = [
        Candidate(plan.setup, zero),
        Candidate(replace(plan.setup, pp=2, micro_batch_size=1, grad_accum_steps=16, pp_schedule="zbv"), zero),
    ]
    pipes = tune_space.plan_pipelines(ranked)
    assert pipes == ((1, "1f1b", None), (2, "zbv", None))
    assert tune_space.plan_pipelines(ranked[:1]) == ()  # no pipelined candidate: the layout stays
    s = tune_space.space_for(plan.setup, spec, pipelines=pipes, compile_=False, strategies=["full_shard"])
    pool = tune_space.make_pool(req, s, gpu.name, first=plan.setup)
    assert any(c.setup.pp == 2 for c in pool.ranked)
    picks = tune_space.select(pool.ranked, 6)
    best = picks[0].setup
    alt = [p for p in picks if tune_space.differs_only_in(p.setup, best, "pipeline")]
    assert alt and alt[0].setup.pp != best.pp or alt[0].setup.pp_schedule != best.pp_schedule
