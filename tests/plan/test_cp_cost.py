"""Context parallelism's cost model (llmctl.plan.flops, llmctl.plan.ring, llmctl.plan.timing): each rank's share of the
attention with and without the head-tail load balance, ring attention's exchanges per layer against a hand count and
the nccl-tests formulas, what the attention hides of them, and invariants that a wrong model would break."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.plan import comm as cm
from llmctl.plan import ring
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import compute_split, evaluate
from llmctl.spec import kernels as kt
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from llmctl.spec.parallel import ParallelDims
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
L8B = resolve_model("llama-3.1-8b")  # 32 layers, 32 heads, 8 kv heads of 128, hidden 4096
S = 131072
NET = cm.Network(intra_gbytes_s=360.0, inter_node_gbytes_s=400.0)  # alpha 2 us inside a node, 8 us across
A = cm.DEFAULT_ALPHA_INTRA_S


def request(**kw) -> PlanRequest:
    args = dict(spec=L8B, gpu=H100, nodes=1, gpus_per_node=8, network=NET, seq_len=S, global_batch_seqs=16)
    args.update(kw)
    return plan_request(**args)


def setup(req: PlanRequest, cp: int = 4, **kw):
    args = dict(nodes=req.nodes, micro_batch=1, grad_accum=2, checkpointing="full", attention="sdpa", compile_=True)
    args.update(kw)
    strategy = args.pop("strategy", "full_shard")
    rotate = args.pop("rotate", "alltoall")
    tp = args.pop("tp", 1)
    s = req.candidate(
        strategy=strategy,
        nodes=args["nodes"],
        micro_batch_size=args["micro_batch"],
        grad_accum_steps=args["grad_accum"],
        checkpointing=args["checkpointing"],
        attention=args["attention"],
        compile=args["compile_"],
        loss_chunk_tokens=0 if tp > 1 else 512,
        tp=tp,
        cp=cp,
        cp_rotate=rotate,
    )
    return s


def ops(c, phase: str = "cp") -> dict[str, cm.CommOp]:
    return {o.name: o for o in c.predicted.comm_ops if o.phase == phase}


# --- compute ----------------------------------------------------------------------------------------------------------
def test_attention_imbalance_without_the_head_tail_split() -> None:
    # rank i of cp holds block row i of the causal score matrix: 2i + 1 half-blocks; the last 2cp - 1 of cp^2 / cp.
    assert ParallelDims(cp=4).attention_imbalance(load_balance=False) == 7 / 4
    assert ParallelDims(cp=8).attention_imbalance(load_balance=False) == 15 / 8
    assert ParallelDims(cp=4).attention_imbalance() == ParallelDims().attention_imbalance(load_balance=False) == 1.0


def test_each_rank_computes_its_share_and_the_slowest_rank_sets_the_step() -> None:
    req = request()
    flat, four = setup(req, cp=1), setup(req, cp=4)
    e1, s1 = compute_split(req, flat)
    e4, s4 = compute_split(req, four)
    # The same matmul FLOPs per token over a quarter of the tokens, at the efficiency of a quarter of the GEMM rows.
    assert s4.matmul_fwd_s * 4 * e4 == pytest.approx(s1.matmul_fwd_s * e1, rel=1e-12)
    assert s4.matmul_bwd_s * 4 * e4 == pytest.approx(s1.matmul_bwd_s * e1, rel=1e-12)
    # Attention: a quarter of the queries, each over the whole sequence, at the kernel's rate for S/4-long calls.
    kernel = kt.kernel_for(four.attention, H100)
    r1, r4 = (kt.attention_rate(H100, kernel, 128, n)[0] for n in (S, S // 4))
    assert s4.attention_fwd_s * 4 == pytest.approx(s1.attention_fwd_s * r1 / r4, rel=1e-9)
    # Without load balance the last rank runs 3/4 more attention (forward, and again in the full recompute).
    e, f = compute_split(req, replace(four, cp_load_balance=False))
    assert e == e4 and f.matmul_fwd_s == pytest.approx(s4.matmul_fwd_s, rel=1e-12)
    assert f.attention_fwd_s == pytest.approx(s4.attention_fwd_s * 7 / 4, rel=1e-9)
    assert f.attention_bwd_s == pytest.approx(s4.attention_bwd_s * 7 / 4, rel=1e-9)


# --- the ring's exchanges, by hand ------------------------------------------------------------------------------------
KV = 2 * 1 * 8 * (S // 4) * 128 * 2  # cp 4: this rank's k and v of 32,768 tokens, 8 kv heads of 128, bf16
DKV = KV * 2  # their gradients, accumulated in fp32


def test_all_to_all_ring_ops_by_hand() -> None:
    req = request()
    c = evaluate(req, setup(req))
    o = ops(c)
    hop = A + KV / 360e9  # nccl-tests sendrecv: bus factor 1, one latency step
    fwd = o["CP K/V send/recv (forward)"]
    assert (fwd.bytes_per_call, fwd.calls_per_step, fwd.n_ranks) == (KV, 32 * 3 * 2, 4)  # 32 layers x 3 hops x 2
    assert fwd.time_per_call_s == pytest.approx(hop, rel=1e-12)
    assert o["CP K/V send/recv (backward)"].calls_per_step == 32 * 3 * 2
    assert o["CP K/V send/recv (recompute)"].calls_per_step == 32 * 3 * 2  # full checkpointing runs the ring again
    dkv = o["CP dK/dV send/recv (backward)"]
    assert (dkv.bytes_per_call, dkv.calls_per_step) == (DKV, 32 * 4 * 2)  # every step's, the last one home
    assert dkv.time_per_call_s == pytest.approx(A + DKV / 360e9, rel=1e-12)
    assert c.predicted.comm_total_s >= sum(op.time_per_step_s for op in o.values())
    # A step's attention (~30 ms here) hides every hop it runs beside; only the last dK/dV hop of each layer's
    # backward has none after it: 32 layers x 2 micro-batches.
    assert c.predicted.cp_comm_exposed_s == pytest.approx(32 * 2 * (A + DKV / 360e9), rel=1e-9)


def test_all_gather_ring_ops_by_hand() -> None:
    req = request()
    o = ops(evaluate(req, setup(req, rotate="allgather", checkpointing="selective")))
    ag = o["CP K/V all-gather (forward)"]
    # One all-gather per layer of the 4 ranks' blocks: S = 4 KV, bus factor 3/4, 3 ring steps.
    assert (ag.bytes_per_call, ag.calls_per_step, ag.collective) == (4 * KV, 32 * 2, "all_gather")
    assert ag.time_per_call_s == pytest.approx(3 * A + 4 * KV * 3 / 4 / 360e9, rel=1e-12)
    assert "CP K/V all-gather (recompute)" not in o  # selective keeps the attention output: no ring again
    assert o["CP dK/dV send/recv (backward)"].collective == "send_recv"  # dK/dV always go hop by hop


def test_exposed_is_everything_without_attention_and_one_hop_with_plenty() -> None:
    s = setup(request(), grad_accum=1)
    net = NET
    for rotate in ("alltoall", "allgather"):
        r = replace(s, cp_rotate=rotate)
        bare = ring.ring_step_comm([ring.RingLayer(count=3, recomputed=2, kv_bytes=KV, attn_fwd_s=0.0)], r, net)
        assert bare.exposed_s == pytest.approx(bare.total_s, rel=1e-12)
        long = ring.ring_step_comm([ring.RingLayer(count=3, recomputed=2, kv_bytes=KV, attn_fwd_s=10.0)], r, net)
        assert long.total_s == bare.total_s
        assert long.exposed_s == pytest.approx(3 * (A + DKV / 360e9), rel=1e-12)


@pytest.mark.parametrize("rotate", ["alltoall", "allgather"])
def test_ring_invariants(rotate: str) -> None:
    req = request(global_batch_seqs=64)
    totals, exposed = [], []
    for cp in (2, 4, 8):
        c = evaluate(req, setup(req, cp=cp, rotate=rotate))
        p = c.predicted
        assert 0 <= p.cp_comm_exposed_s <= sum(o.time_per_step_s for o in ops(c).values())
        assert p.comm_exposed_s <= p.comm_total_s
        totals.append(sum(o.time_per_step_s for o in ops(c).values()))
        exposed.append(p.cp_comm_exposed_s)
        # More bandwidth never predicts a slower step; less never a faster one.
        fast = evaluate(replace(req, network=NET.scaled(2.0)), c.setup).predicted
        slow = evaluate(replace(req, network=NET.scaled(0.01)), c.setup).predicted
        assert fast.step_time_s <= p.step_time_s <= slow.step_time_s
        assert slow.cp_comm_exposed_s > p.cp_comm_exposed_s
    # Each rank sends (cp-1)/cp of the sequence's keys and values per pass: the ring's time grows with cp.
    assert totals[0] < totals[1] < totals[2]


def test_without_load_balance_the_step_is_slower() -> None:
    req = request()
    s = setup(req)
    bal, flat = evaluate(req, s).predicted, evaluate(req, replace(s, cp_load_balance=False)).predicted
    assert flat.step_time_s > bal.step_time_s and flat.tokens_per_s < bal.tokens_per_s
    assert flat.compute_s > bal.compute_s


def test_fsdp_runs_over_dp_shard_times_cp_and_tp_moves_this_ranks_tokens() -> None:
    req = request()
    c = evaluate(req, setup(req, cp=4))
    gathers = [o for o in c.predicted.comm_ops if o.collective == "all_gather" and o.phase in ("forward", "backward")]
    assert gathers and all(o.n_ranks == 8 for o in gathers)  # dp_shard 2 x cp 4
    ddp = evaluate(req, setup(req, cp=4, strategy="no_shard"))  # 2 replicas of a 4-rank FSDP group over cp
    kinds = {(o.collective, o.n_ranks) for o in ddp.predicted.comm_ops if o.phase != "cp"}
    assert ("all_gather", 4) in kinds and ("all_reduce", 2) in kinds
    t = evaluate(req, setup(req, cp=2, tp=2))
    tp_ops = ops(t, "tp")
    assert tp_ops and all(o.bytes_per_call == 1 * (S // 2) * 4096 * 2 for o in tp_ops.values())
    assert ops(t)["CP K/V send/recv (forward)"].bytes_per_call == 2 * 1 * 4 * (S // 2) * 128 * 2  # 8 / tp kv heads


def test_a_ring_across_nodes_hops_at_one_gpus_nic_share() -> None:
    req = request(nodes=2, global_batch_seqs=16)
    o = ops(evaluate(req, setup(req, cp=16, nodes=2)))
    hop = o["CP K/V send/recv (forward)"]
    assert hop.scope == "cross" and hop.busbw_gbytes_s == 400.0 / 8  # node's 400 GB/s over its 8 GPUs' NICs
    kv = 2 * 1 * 8 * (S // 16) * 128 * 2
    assert hop.time_per_call_s == pytest.approx(cm.DEFAULT_ALPHA_INTER_S + kv / 50e9, rel=1e-12)
    inside = ops(evaluate(request(), setup(request(), cp=8)))["CP K/V send/recv (forward)"]
    assert inside.scope == "intra" and inside.busbw_gbytes_s == 360.0
