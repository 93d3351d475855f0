"""Pipeline parallelism's split, placement, in-flight counts and schedule names (llmctl.spec.pipeline)."""

from __future__ import annotations

import pytest

from llmctl.errors import LlmctlError, RuleError
from llmctl.spec.pipeline import (
    Schedule,
    bubble_fraction,
    in_flight,
    max_stages,
    schedule,
    split_layers,
    stages_of_rank,
)
from llmctl.spec.setup import TrainSetup


@pytest.mark.parametrize(
    ("layers", "stages", "blocks"),
    [
        (8, 2, (4, 4)),  # 10 effective layers, 5 each: the embedding and the head take one each
        (8, 4, (2, 3, 2, 1)),  # 10 over 4: the first two stages take the extra layer
        (126, 16, (7,) + (8,) * 14 + (7,)),  # Llama 3.1 405B: 128 effective layers, 8 per stage
        (32, 1, (32,)),
        (2, 4, (0, 1, 1, 0)),  # the most stages: embedding-only and head-only ends
    ],
)
def test_split_deals_out_layers_the_torchtitan_way(layers, stages, blocks):
    parts = split_layers(layers, stages)
    assert tuple(p.num_blocks for p in parts) == blocks
    assert [b for p in parts for b in p.blocks] == list(range(layers))  # every block once, in order
    assert [p.embedding for p in parts] == [True] + [False] * (stages - 1)
    assert [p.head for p in parts] == [False] * (stages - 1) + [True]


def test_split_refuses_more_stages_than_layers():
    assert max_stages(2) == 4
    with pytest.raises(LlmctlError, match="5 pipeline stages cannot split 2 layers"):
        split_layers(2, 5)


def test_placement_loops_or_makes_a_v():
    assert [stages_of_rank(Schedule.INTERLEAVED_1F1B, r, 4, 2) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [stages_of_rank(Schedule.ZBV, r, 4, 2) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert stages_of_rank(Schedule.ONE_F_ONE_B, 2, 4, 1) == (2,)


def test_in_flight_by_schedule():
    assert [in_flight(Schedule.ONE_F_ONE_B, r, 4, 8, 1) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight(Schedule.ONE_F_ONE_B, 0, 4, 2, 1) == 2  # fewer micro-batches than stages
    assert [in_flight(Schedule.GPIPE, r, 4, 8, 1) for r in range(4)] == [8] * 4
    # torch's ScheduleInterleaved1F1B warm-up: (v - 1) pp + 2 (pp - rank - 1), plus the one in steady state
    assert [in_flight(Schedule.INTERLEAVED_1F1B, r, 4, 8, 2) for r in range(4)] == [11, 9, 7, 5]
    assert in_flight(Schedule.ZBV, 3, 4, 8, 2) == 8  # 1F1B's memory on every rank, in half-stage units


def test_bubble_shrinks_with_virtual_stages():
    assert bubble_fraction(Schedule.ONE_F_ONE_B, 8, 32, 1) == pytest.approx(7 / 32)
    assert bubble_fraction(Schedule.INTERLEAVED_1F1B, 8, 32, 4) == pytest.approx(7 / 128)
    assert bubble_fraction(Schedule.GPIPE, 1, 1, 1) == 0.0


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("1F1B", Schedule.ONE_F_ONE_B),
        ("Interleaved1F1B", Schedule.INTERLEAVED_1F1B),
        ("interleaved_1f1b", Schedule.INTERLEAVED_1F1B),
        ("ScheduleZBVZeroBubble", Schedule.ZBV),
        ("GPipe", Schedule.GPIPE),
    ],
)
def test_torch_and_torchtitan_names_are_read(name, want):
    assert schedule(name) is want


def test_unknown_schedule_names_the_choices():
    with pytest.raises(LlmctlError, match="unknown pipeline schedule 'pipedream'.*1f1b"):
        schedule("pipedream")


def test_setup_resolves_stages_and_microbatches():
    s = TrainSetup(nodes=1, gpus_per_node=8, pp=4, pp_schedule="interleaved", grad_accum_steps=16, pp_microbatches=8)
    assert (s.pp_schedule, s.virtual_stages, s.pipeline_stages, s.pipeline_microbatches) == (
        Schedule.INTERLEAVED_1F1B,
        2,
        8,
        8,
    )
    assert TrainSetup(nodes=1, gpus_per_node=8, pp=2, grad_accum_steps=4).pipeline_microbatches == 4


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"pp_schedule": "zbv", "pp_virtual_stages": 3}, "zbv runs 2 stages per rank"),
        ({"pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 1}, "loops over 2 or more"),
        ({"pp_schedule": "1f1b", "pp_virtual_stages": 2}, "runs one stage per rank"),
        ({"grad_accum_steps": 6, "pp_microbatches": 4}, "pp microbatches 4 must divide the 6"),
    ],
)
def test_rules_refuse_in_one_line(kw, match):
    with pytest.raises(RuleError, match=match):
        TrainSetup(nodes=1, gpus_per_node=8, pp=4, **kw)
    # at pp 1 the pipeline decisions are not asked
    if "grad_accum_steps" in kw:
        TrainSetup(nodes=1, gpus_per_node=8, pp=1, **kw)


@pytest.mark.parametrize("name", ["pp_microbatches", "pp_virtual_stages"])
def test_zero_is_refused_not_read_as_the_default(name):
    with pytest.raises(LlmctlError, match=f"{name.replace('_', ' ')} must be a positive integer, got 0"):
        TrainSetup(nodes=1, gpus_per_node=8, **{name: 0})
