"""Pipeline parallelism's cost terms (llmctl.plan.stages, the pp paths of llmctl.plan.comm and llmctl.plan.timing):
the bubble of each schedule, the hops between stages and the link each crosses, the heaviest rank's share, FSDP
once per schedule run, and what a pp > 1 prediction carries. Hand-checked numbers from the formulas' sources."""

from __future__ import annotations

import pytest

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan import stages
from llmctl.plan.network import p2p_bandwidth
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import evaluate
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from llmctl.spec.parallel import ParallelDims
from llmctl.spec.pipeline import Schedule
from llmctl.spec.setup import TrainSetup

H100 = resolve_gpu("H100-SXM")
NET = cm.Network(H100.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, 3200 / 8)


# --- the bubble ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sched", "pp", "m", "v", "expected"),
    [
        (Schedule.ONE_F_ONE_B, 8, 64, 1, 7 / 64),  # (p - 1) / m, arXiv 2104.04473 eq. 1
        (Schedule.GPIPE, 4, 16, 1, 3 / 16),
        (Schedule.INTERLEAVED_1F1B, 8, 64, 2, 7 / 128),  # (p - 1) / (v m), section 2.2.1
        (Schedule.INTERLEAVED_1F1B, 8, 64, 4, 7 / 256),
        (Schedule.ONE_F_ONE_B, 1, 64, 1, 0.0),
    ],
)
def test_bubble_of_the_1f1b_family(sched: Schedule, pp: int, m: int, v: int, expected: float) -> None:
    assert stages.bubble(sched, pp, m, v, 1.0, 2.0, 1.0) == pytest.approx(expected)


def test_zbv_bubble_is_the_papers_from_f_b_w() -> None:
    """ZB-V idles (p - 1)(T_F + T_B - 2 T_W) a run (arXiv 2401.10241 section 6), T_* a stage's (half a rank's):
    none when F = B = W; with W = 0 (nothing to fill with) (p - 1) x 1.5 of the rank's 3 units a micro-batch."""
    assert stages.bubble(Schedule.ZBV, 8, 32, 2, f_s=1.0, b_s=2.0, w_s=1.0) == 0.0
    # f = 1, b = 2 (B 2, W 0): per stage T_F 0.5, T_B 1, T_W 0 -> idle 7 x 1.5 over 32 x 3
    assert stages.bubble(Schedule.ZBV, 8, 32, 2, f_s=1.0, b_s=2.0, w_s=0.0) == pytest.approx(7 * 1.5 / (32 * 3))
    # never negative: W larger than F + B - W
    assert stages.bubble(Schedule.ZBV, 8, 32, 2, f_s=1.0, b_s=4.0, w_s=3.0) == 0.0


# --- the hops and their links -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nodes", "g", "tp", "pp", "expected"),
    [
        (1, 8, 1, 2, (1, 0)),  # stride 4: both stages in the node
        (2, 8, 8, 2, (0, 1)),  # stride 8: each stage a node
        (2, 8, 4, 4, (2, 1)),  # stride 4: stages 0-1 on node 0, 2-3 on node 1, the middle hop crosses
        (64, 8, 8, 8, (0, 7)),  # 405B's PP 8 x TP 8 x FSDP 8: every hop crosses (stride 64)
    ],
)
def test_hops_inside_and_between_nodes(nodes: int, g: int, tp: int, pp: int, expected: tuple[int, int]) -> None:
    dims = ParallelDims.from_strategy("full_shard", nodes, g, tp=tp, pp=pp)
    assert stages.hops(dims, g) == expected


def test_p2p_priced_on_the_link_the_hop_crosses() -> None:
    """Inside a node a send runs on the GPU's link (NVLink busbw); between nodes on one GPU's share of the node's
    NICs (3200 Gbit/s / 8 GPUs = 50 GB/s): the same activation takes 360 / 50 times longer across."""
    g = 8
    assert p2p_bandwidth(NET, "intra", 2**26, g) == pytest.approx(NET.intra_gbytes_s)
    assert p2p_bandwidth(NET, "inter", 2**26, g) == pytest.approx(400 / 8)
    spec = resolve_model("llama-3.1-8b")
    one = TrainSetup(nodes=1, gpus_per_node=g, pp=2, micro_batch_size=1, grad_accum_steps=8, seq_len=4096)
    two = TrainSetup(nodes=2, gpus_per_node=g, tp=8, pp=2, micro_batch_size=1, grad_accum_steps=8, seq_len=4096)
    intra, inter = (stages.p2p_comm(s, spec.hidden_size, NET, 0.8) for s in (one, two))
    size = 1 * 4096 * spec.hidden_size * 2  # micro_batch x seq x hidden x bf16
    assert intra.ops[0].bytes_per_call == inter.ops[0].bytes_per_call == size
    assert intra.ops[0].scope == "intra" and inter.ops[0].scope == "inter"
    assert intra.ops[0].time_per_call_s == pytest.approx(NET.alpha_intra_s + size / (NET.intra_gbytes_s * 1e9))
    assert inter.ops[0].time_per_call_s == pytest.approx(NET.alpha_inter_s + size / (50 * 1e9))
    # 8 micro-batches, one stage a rank: 8 sends forward, 8 back; the fill and drain (2 hops a run) all exposed
    assert intra.ops[0].calls_per_step == 16
    t = intra.ops[0].time_per_call_s
    assert intra.exposed_s == pytest.approx(2 * t + 0.2 * 14 * t)


def test_looped_schedules_send_v_times() -> None:
    spec = resolve_model("llama-3.1-8b")
    base = dict(nodes=1, gpus_per_node=8, pp=2, micro_batch_size=1, grad_accum_steps=8, seq_len=4096)
    flat = stages.p2p_comm(TrainSetup(**base), spec.hidden_size, NET, 0.8)
    looped = stages.p2p_comm(
        TrainSetup(**base, pp_schedule="interleaved-1f1b", pp_virtual_stages=4), spec.hidden_size, NET, 0.8
    )
    assert looped.ops[0].calls_per_step == 4 * flat.ops[0].calls_per_step


# --- what a rank runs ---------------------------------------------------------------------------------------------
def test_rank_shares_cover_the_model_once() -> None:
    """Every block on exactly one rank; an untied model's parameters and matmul FLOPs shared out whole; the head on
    the last rank (1F1B), on rank 0 under ZB-V's V."""
    spec = resolve_model("llama-3.1-8b")
    for sched, v in (("1f1b", None), ("interleaved-1f1b", 2), ("zbv", None)):
        s = TrainSetup(nodes=1, gpus_per_node=8, pp=4, pp_schedule=sched, pp_virtual_stages=v)
        shares = [stages.rank_share(spec, s, r) for r in range(4)]
        assert sorted(b for x in shares for b in x.blocks) == list(range(spec.num_layers))
        assert sum(x.params for x in shares) == pytest.approx(1.0)
        assert sum(x.matmul for x in shares) == pytest.approx(1.0)
        head = [x.rank for x in shares if x.head]
        assert head == ([0] if sched == "zbv" else [3])
    assert stages.heaviest_rank(spec, TrainSetup()) is stages.WHOLE


# --- FSDP once per schedule run -----------------------------------------------------------------------------------
def test_fsdp_under_pp_gathers_once_a_run() -> None:
    dims = ParallelDims.from_strategy("full_shard", 2, 8, pp=2)
    shape = cm.CommShape(params=8_000_000_000, num_layers=16)
    with pytest.raises(InputError):
        cm.step_comm(dims, shape, 8, 2, 1.0, 2.0, NET)
    c = cm.step_comm(dims, shape, 8, 2, 1.0, 2.0, NET, pipelined=True)
    names = [o.name for o in c.ops]
    assert not any("backward" in n and "all-gather" in n for n in names)
    gather = next(o for o in c.ops if o.collective == "all_gather")
    assert gather.calls_per_step == 16 * 2 and gather.n_ranks == 8  # 16 layers, 2 runs; the stage's FSDP group


# --- a prediction under pp ------------------------------------------------------------------------------------------
def test_pp_prediction_carries_its_bubble_and_sends() -> None:
    spec = resolve_model("llama-3.1-70b")
    req = PlanRequest(spec=spec, gpu=H100, nodes=8, gpus_per_node=8, network=NET, seq_len=4096)
    s = req.candidate(
        nodes=8, tp=8, pp=4, pp_schedule="interleaved-1f1b", pp_virtual_stages=2, micro_batch_size=1,
        grad_accum_steps=16, checkpointing="full",
    )  # fmt: skip
    c = evaluate(req, s)
    p = c.predicted
    assert p.bubble_s > 0 and p.split["bubble"] == p.bubble_s
    assert p.p2p_comm_exposed_s > 0
    d = c.as_dict()
    assert (d["pp"], d["pp_schedule"], d["pp_microbatches"], d["pp_virtual_stages"]) == (4, "interleaved-1f1b", 16, 2)
    assert "PP 4 (interleaved-1f1b, v 2" in c.label
    # interleaved: (p - 1) / (v m) = 3 / 32 of the ideal compute (the optimizer step, outside it, is under 2%)
    assert p.bubble_s / (p.compute_s - p.bubble_s) == pytest.approx(3 / 32, rel=0.02)
    flat = evaluate(req, req.candidate(nodes=8, tp=8, micro_batch_size=1, grad_accum_steps=4, checkpointing="full"))
    assert "pp" not in flat.as_dict() and "bubble" not in flat.predicted.split
