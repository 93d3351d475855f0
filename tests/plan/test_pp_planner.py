"""The planner's pipeline-parallel search and its explanation (llmctl.plan.search, llmctl.plan.space,
llmctl.plan.explain_pipeline): the pins it honours, the schedules it ranks, and why PP won or lost on the issue's
two clusters. The search proposes pipelines only where llmctl's engine runs them (llmctl.spec.rules.ENGINE_RULES);
`engine_runs_pp` stands for the engine's lifting of that rule."""

from __future__ import annotations

import re

import pytest

from llmctl.plan import comm as cm
from llmctl.plan import planner as pl
from llmctl.plan import space
from llmctl.plan.request import PlanRequest
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
IB_NET = cm.Network(H100.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, 3200 / 8)  # 8 x 400G NICs a node


@pytest.fixture
def engine_runs_pp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(space, "engine_problem", lambda setup: None)


def h100(model: str, nodes: int, **kw) -> PlanRequest:
    args = dict(spec=resolve_model(model), gpu=H100, nodes=nodes, gpus_per_node=8, network=IB_NET)
    args.update(kw)
    return plan_request(**args)


def test_pp_not_proposed_while_the_engine_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    req = h100("llama-3.1-8b", 1, seq_len=2048)
    assert space.space_for(req).pps == [1, 2, 4, 8]  # the engine runs pipelines: searched
    monkeypatch.setattr(space, "engine_problem", lambda setup: "no pipelines here")
    assert space.space_for(req).pps == [1]
    result = pl.plan(req)
    assert all(c.setup.pp == 1 for c in result.variants) and result.pp_choice == ""


def test_pins_are_honoured(engine_runs_pp: None) -> None:
    req = h100("llama-3.1-8b", 1, seq_len=2048, pp=2, pp_schedule="zbv", pp_microbatches=4)
    result = pl.plan(req)
    assert result.variants
    for c in result.variants:
        s = c.setup
        assert (s.pp, str(s.pp_schedule), s.pp_microbatches) == (2, "zbv", 4)
        assert s.grad_accum_steps % 4 == 0
    assert result.pp_choice.startswith("PP 2 zbv")


def test_pinned_interleaved_tries_its_virtual_stages(engine_runs_pp: None) -> None:
    req = h100("llama-3.1-8b", 1, seq_len=2048, pp=2, pp_schedule="interleaved-1f1b")
    found = {c.setup.virtual_stages for c in pl.plan(req).variants}
    assert found <= {2, 4, 8} and len(found) > 1


def test_pp_1_pinned_says_so(engine_runs_pp: None) -> None:
    result = pl.plan(h100("llama-3.1-8b", 1, seq_len=2048, pp=1))
    assert all(c.setup.pp == 1 for c in result.variants)
    assert result.pp_choice == "pipeline parallelism: pinned off (--pp 1)"


def test_space_tries_powers_of_two_and_the_schedules(engine_runs_pp: None) -> None:
    sp = space.space_for(h100("llama-3.1-70b", 8, seq_len=2048))
    assert sp.pps == [1, 2, 4, 8, 16, 32, 64]  # 80 layers + 2 split into up to 82 stages; 64 GPUs
    assert ("1f1b", None) in sp.schedules and ("zbv", None) in sp.schedules
    assert {v for s, v in sp.schedules if s == "interleaved-1f1b"} == {2, 4, 8}
    assert not any(s == "gpipe" for s, _ in sp.schedules)


def test_405b_on_64_nodes_finds_pp_and_ranks_interleaved_above_1f1b(engine_runs_pp: None) -> None:
    """`llmctl plan llama-3.1-405b --gpu H100 --nodes 64 --gpus-per-node 8 --seq-len 8192` (NICs: 3200 Gbit/s a
    node): PP setups are planned, and interleaved 1F1B ranks above 1F1B: the best of each, and at PP 8 (the published
    PP 8 x TP 8 x FSDP 8 layout) (the bubble shrinks v times for v times the sends; at the deepest pipelines the
    receive buffers of v x the micro-batches in flight can leave interleaved fewer micro-batches a run, so it is not
    asserted at every degree)."""
    result = pl.plan(h100("llama-3.1-405b", 64, seq_len=8192))
    piped = [c for c in result.variants if c.setup.pp > 1]
    assert piped, result.rejected[:5]
    best: dict[tuple[int, str], float] = {}
    for c in piped:
        k = (c.setup.pp, str(c.setup.pp_schedule))
        best[k] = max(best.get(k, 0.0), c.predicted.tokens_per_s)
    assert best[(8, "interleaved-1f1b")] > best[(8, "1f1b")]
    top_interleaved = max(v for (_, s), v in best.items() if s == "interleaved-1f1b")
    top_1f1b = max(v for (_, s), v in best.items() if s == "1f1b")
    assert top_interleaved > top_1f1b
    assert re.search(r"PP \d+", result.pp_choice) and "bubble" in result.pp_choice


def _pct(text: str, after: str) -> float:
    m = re.search(re.escape(after) + r" (\d+\.\d)%", text)
    assert m, text
    return float(m.group(1)) / 100


def test_70b_on_8_nodes_says_whether_pp_or_fsdp_x_tp_wins_and_why(engine_runs_pp: None) -> None:
    """`llmctl plan llama-3.1-70b --gpu H100 --nodes 8 --gpus-per-node 8`: the explanation names the winner of PP
    against FSDP x TP, and its reasons are the candidates' own numbers: the gap, the bubble's share of the PP
    setup's step, and the data-parallel communication each exposes."""
    result = pl.plan(h100("llama-3.1-70b", 8, seq_len=2048))
    text, chosen = result.pp_choice, result.chosen
    piped = chosen if chosen.setup.pp > 1 else next(c for c in result.variants if c.setup.pp > 1)
    flat = chosen if chosen.setup.pp == 1 else next(c for c in result.variants if c.setup.pp == 1)
    winner, loser = (piped, flat) if chosen.setup.pp > 1 else (flat, piped)
    assert winner.predicted.tokens_per_s >= loser.predicted.tokens_per_s
    if chosen.setup.pp > 1:
        assert text.startswith(f"PP {piped.setup.pp} {piped.setup.pp_schedule}")
        assert "the best without PP" in text
    else:
        assert text.startswith(f"PP {piped.setup.pp} lost")
    gap = 1 - loser.predicted.tokens_per_s / winner.predicted.tokens_per_s
    assert _pct(text, "predicts") == pytest.approx(gap, abs=0.0006)
    p = piped.predicted
    assert _pct(text, "bubble") == pytest.approx(p.bubble_s / p.step_time_s, abs=0.0006)
    dp = p.comm_exposed_s - p.tp_comm_exposed_s - p.cp_comm_exposed_s - p.p2p_comm_exposed_s
    assert f"data-parallel communication {dp:.2f} s exposed" in text


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        ({"pp": 3}, "--pp 3 does not divide the 8 GPUs"),
        ({"pp": 4, "tp": 4}, "--pp 4 x --tp 4 does not divide the 8 GPUs"),
    ],
)
def test_bad_pp_pins_are_one_line(pins: dict, message: str) -> None:
    from llmctl.errors import InputError

    with pytest.raises(InputError, match=re.escape(message)):
        h100("llama-3.1-8b", 1, seq_len=2048, **pins)


@pytest.mark.parametrize("seq_len", [8192, 65536])
def test_pp_with_cp_pinned_is_one_line_naming_it(seq_len: int) -> None:
    """Every pipeline family is cp 1: both pinned was "no candidate" (8k) or a loss-chunk note (64k)."""
    from llmctl.errors import InputError

    with pytest.raises(InputError, match=re.escape("--pp 2 with --cp 2: pipeline parallelism is planned at cp 1")):
        pl.plan(h100("llama-3.1-8b", 1, seq_len=seq_len, pp=2, cp=2))
    assert pl.plan(h100("llama-3.1-8b", 1, seq_len=8192, pp=1, cp=2)).chosen.setup.cp == 2  # pp 1 is no pipeline


def test_pp_beyond_the_layers_is_refused() -> None:
    from llmctl.errors import InputError

    with pytest.raises(InputError, match="4 layers split into at most 6 pipeline stages"):
        h100("llama-tiny", 1, seq_len=64, pp=8)


def test_pp_microbatches_that_divide_nothing_say_so(engine_runs_pp: None) -> None:
    from llmctl.errors import DoesNotFitError

    with pytest.raises(DoesNotFitError, match="--pp-microbatches 3 divides the accumulation of no micro-batch"):
        pl.plan(h100("llama-3.1-8b", 1, seq_len=2048, pp=2, pp_microbatches=3))
