"""Expert parallelism's cost model (llmctl.plan.experts, llmctl.plan.comm, llmctl.plan.kernel_time): the all-to-all
bytes and calls of a MoE layer against a hand count, their price on the links, the experts' FSDP collectives over the
efsdp group, the grouped GEMMs' efficiency, and what stays as it was (dense models, ep 1)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.plan import comm as cm
from llmctl.plan import experts as ex
from llmctl.plan import kernel_time, network
from llmctl.plan.timing import evaluate
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100-SXM")
QWEN = resolve_model("qwen3-30b-a3b")  # 48 MoE layers, hidden 2048, 128 experts of 768, top-8
L8B = resolve_model("llama-3.1-8b")
NET = cm.Network(intra_gbytes_s=360.0, inter_node_gbytes_s=400.0)
A = cm.DEFAULT_ALPHA_INTRA_S


def request(spec=QWEN, nodes: int = 1, **kw):
    args = dict(spec=spec, gpu=H100, nodes=nodes, gpus_per_node=8, network=NET, seq_len=2048, global_batch_seqs=64)
    args.update(kw)
    return plan_request(**args)


def setup(req, **kw):
    args = dict(
        strategy="full_shard",
        nodes=req.nodes,
        micro_batch_size=1,
        grad_accum_steps=2,
        checkpointing="none",
        attention="sdpa",
        compile=True,
    )
    args.update(kw)
    return req.candidate(**args)


def test_alltoall_bytes_per_layer_by_hand():
    """One rank of micro-batch 1 x 2048 tokens routes 2048 x 8 rows of 2048 bf16 elements: 64 MiB per all-to-all;
    a MoE layer runs 4 (dispatch and combine, forward and backward): 256 MiB a micro-batch per layer."""
    assert QWEN.hidden_size == 2048 and QWEN.layers[0].mlp.experts_per_token == 8
    s = setup(request(), ep=8)
    one = ex.alltoall_bytes(2048, 8, 2048, 2)
    assert one == 2048 * 8 * 2048 * 2 == 64 * 2**20
    c = ex.ep_comm(QWEN, s, 2048, NET)
    (op,) = c.ops
    assert op.bytes_per_call == one
    assert op.calls_per_step == 4 * 48 * 2  # 4 a layer, 48 MoE layers, 2 micro-batches
    assert op.collective == "all_to_all" and op.n_ranks == 8 and op.scope == "intra"
    # inside a node: alpha x (ep - 1) + S (ep - 1)/ep over the intra-node busbw (nccl-tests alltoall)
    assert op.time_per_call_s == pytest.approx(7 * A + one * 7 / 8 / 360e9)
    assert c.exposed_s == c.total_s == pytest.approx(op.time_per_step_s)  # the engine does not overlap them


@pytest.mark.parametrize(("ckpt", "again"), [("none", 0), ("full", 48), ("selective", 48), ("partial:2", 24)])
def test_recompute_reruns_dispatch_and_combine(ckpt, again):
    s = setup(request(), ep=4, checkpointing=ckpt)
    assert ex.alltoall_calls(QWEN, s) == (4 * 48, 2 * again)


def test_alltoall_across_nodes_prices_the_nics():
    req = request(nodes=2, global_batch_seqs=64)
    s = setup(req, ep=16)
    (op, *_) = ex.ep_comm(QWEN, s, 2048, NET).ops
    assert op.scope == "cross"
    assert op.time_per_call_s == pytest.approx(network.alltoall_time(NET, 64 * 2**20, 16, 8))


def test_no_alltoall_at_ep_1_nor_for_a_dense_model():
    assert ex.ep_comm(QWEN, setup(request()), 2048, NET).ops == []
    assert ex.ep_comm(L8B, setup(request(L8B)), 2048, NET).ops == []
    assert ex.routed_expert_params(L8B) == 0


def test_routed_params_are_the_expert_tensors():
    m = QWEN.layers[0].mlp
    assert ex.layer_expert_params(QWEN.layers[0], 2048) == m.num_experts * 3 * 2048 * m.intermediate_size
    assert ex.routed_expert_params(QWEN) == 48 * 128 * 3 * 2048 * 768


def test_experts_fsdp_over_the_efsdp_group():
    """At ep 4 on 8 ranks each rank gathers its 32 local experts per layer over 2 efsdp ranks; the dense part over
    all 8 loses the experts; every byte a rank gathers adds up to the dense part plus 1/ep of the experts."""
    req = request()
    s1, s4 = setup(req), setup(req, ep=4)
    ops1 = {o.name: o for o in evaluate(req, s1).predicted.comm_ops}
    ops4 = {o.name: o for o in evaluate(req, s4).predicted.comm_ops}
    experts = ex.routed_expert_params(QWEN)
    local = ops4["all-gather of the local experts (forward)"]
    assert local.n_ranks == 2 and local.scope == "intra"
    assert local.bytes_per_call == pytest.approx(experts / 4 / 48 * 2)
    assert ops4["all-gather (forward)"].bytes_per_call == pytest.approx(
        ops1["all-gather (forward)"].bytes_per_call - experts / 48 * 2
    )
    rs = ops4["reduce-scatter of the local experts"]
    assert rs.bytes_per_call == pytest.approx(experts / 4 / 48 * 4) and rs.calls_per_step == 48 * 2


def test_experts_need_no_fsdp_when_ep_takes_every_shard_rank():
    req = request()
    names = [o.name for o in evaluate(req, setup(req, ep=8)).predicted.comm_ops]
    assert not any("local experts" in n for n in names)


def test_replicas_allreduce_every_gradient_shard_as_before():
    req = request(nodes=2)
    s1 = setup(req, strategy="hybrid_shard")
    s8 = replace(s1, ep=8)
    s8 = setup(req, strategy="hybrid_shard", ep=8)
    ar = [
        next(o for o in evaluate(req, s).predicted.comm_ops if o.collective == "all_reduce").bytes_per_call
        for s in (s1, s8)
    ]
    assert ar[0] == pytest.approx(ar[1])


def test_grouped_gemms_beat_the_expert_loop_and_dense_models_do_not_change():
    peak = H100.peak_tflops("bf16")
    loop = kernel_time.gemm_efficiency(H100, QWEN, 2048, 1, peak)
    grouped = kernel_time.gemm_efficiency(H100, QWEN, 2048, 1, peak, ep=8)
    assert grouped > loop
    # the grouped GEMMs' efficiency depends on the rows a rank receives, not on how many ranks hold the experts
    assert kernel_time.gemm_efficiency(H100, QWEN, 2048, 1, peak, ep=2) == grouped
    assert kernel_time.gemm_efficiency(H100, L8B, 2048, 1, peak, ep=8) == kernel_time.gemm_efficiency(
        H100, L8B, 2048, 1, peak
    )


def test_ep_shrinks_fsdp_copies_not_the_flops():
    req = request()
    s1, s8 = setup(req), setup(req, ep=8)
    assert kernel_time.fsdp_copy_bytes(QWEN, s8) < kernel_time.fsdp_copy_bytes(QWEN, s1)
    c1, c8 = evaluate(req, s1).predicted, evaluate(req, s8).predicted
    assert c8.split["matmul"] < c1.split["matmul"]
    assert c8.mfu > c1.mfu  # same model FLOPs, less time


def test_imbalance_scales_the_busiest_ranks_rows(monkeypatch):
    req = request()
    s = setup(req, ep=8)
    base = evaluate(req, s).predicted
    monkeypatch.setattr(ex, "IMBALANCE", 1.5)
    slow = evaluate(req, s).predicted
    assert slow.split["matmul"] > base.split["matmul"]
    a2a = [next(o for o in p.comm_ops if o.phase == "ep") for p in (base, slow)]
    assert a2a[1].bytes_per_call == pytest.approx(1.5 * a2a[0].bytes_per_call)  # the busiest rank's bytes
    assert ex.alltoall_seconds(slow.comm_ops) > ex.alltoall_seconds(base.comm_ops)


def test_grouped_gemm_shapes_by_hand() -> None:
    """Qwen3-30B-A3B (hidden 2048, experts of width 768, top-8): a rank that received 4096 tokens' rows runs gate_up
    as (32768 rows, 2048 -> 1536: gate and up fused) and down as (32768, 768 -> 2048); 1.5x the rows at imbalance 1.5."""
    spec = resolve_model("qwen3-30b-a3b")
    layer = next(la for la in spec.layers if la.mlp.moe)
    assert ex.grouped_gemms(layer, spec.hidden_size, 4096) == [(32768, 2048, 1536), (32768, 768, 2048)]
    assert ex.grouped_gemms(layer, spec.hidden_size, 4096, imbalance=1.5)[0][0] == 49152
