"""Context parallelism in the memory model, checked by hand on llama-tiny (hidden 256, 8 heads and 4 kv heads of 32,
4 layers, MLP 688, vocabulary 320) with one 1,024-token sequence: each rank's activations are those of its S/cp tokens,
the states shard over dp_shard x cp, and ring attention's transient buffers are the tensors torch's
`_templated_ring_attention` and its backward hold (counted below from that code, term by term)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from llmctl.plan import memory as mem
from llmctl.plan.memory.estimate import RING_BACKWARD_GRADS, RING_BACKWARD_KV, RING_FORWARD_KV, RING_FORWARD_MERGE
from llmctl.spec.models import resolve_model
from llmctl.spec.setup import TrainSetup

TINY = resolve_model("llama-tiny")
S = 1024


def setup(**kw) -> TrainSetup:
    args = dict(nodes=1, gpus_per_node=8, seq_len=S, cp=4, micro_batch_size=1, attention="sdpa")
    args.update(kw)
    return TrainSetup(**args)


def comps(s: TrainSetup) -> dict[str, int]:
    return {c.name: c.bytes for c in mem.estimate(TINY, s).components}


# --- ring attention's buffers, by hand --------------------------------------------------------------------------------
# cp 4: s = 1024 / 4 = 256 tokens per rank; bf16 (2 bytes).
Q = 1 * 8 * 256 * 32  # elements of q (and of the attention output): b x heads x s x head size = 65,536
K = 1 * 4 * 256 * 32  # elements of k (and of v): kv heads = 32,768
KV = 2 * K * 2  # bytes of this rank's k and v, concatenated for the ring: 131,072
LSE = 1 * 8 * 256  # logsumexp elements (fp32): 2,048


def test_ring_buffers_all_gather_rotation_by_hand() -> None:
    # Forward, at a ring step after the first (the larger moment here): the all-gathered K/V of all 4 ranks (4 KV),
    # and the fp32 merge: the running output (4 bytes/elem), the step's bf16 output (2) and its fp32 upcast (4), two
    # fp32 temporaries of out - sigmoid(lse_i - lse) * (out - out_i) (8): 18 bytes per output element; four fp32
    # logsumexps (16 bytes per element).
    later = (4 * KV, 18 * Q + 16 * LSE)
    # The first step instead: the gathered buffer, the concatenated send copy and the contiguous copies of k and v
    # (6 KV), the step's bf16 output and its upcast (the running output): 6 bytes per element, one logsumexp (4).
    first = (6 * KV, 6 * Q + 4 * LSE)
    assert sum(later) == 1_736_704 and sum(first) == 1_187_840  # the later step is the peak
    ring = mem.ring_buffers(TINY, setup())
    assert (ring.forward_kv, ring.forward_merge) == later == (524_288, 1_212_416)
    # Backward, at a later step: the gathered K/V again (4 KV); grad_query's fp32 accumulator (4Q); the dK/dV
    # accumulator received, its concatenated send copy and the next being received, fp32 (3 x 8K); the step's bf16
    # gradients of q, k, v (2(Q + 2K)); the head-tail split's torch.cat of a half-updated accumulator
    # (max(4Q, 8K)).
    assert ring.backward_kv == 4 * KV == 524_288
    assert ring.backward_grads == 4 * Q + 24 * K + 2 * (Q + 2 * K) + max(4 * Q, 8 * K) == 1_572_864
    assert not ring.backward_is_recompute


@pytest.mark.parametrize(
    ("cp", "rotate", "step", "blocks"),
    [
        (4, "allgather", 0, 6),  # the gathered 4, the concatenated send copy, the contiguous copies of k and v
        (4, "allgather", 1, 4),  # the gathered buffer alone
        (2, "allgather", 0, 4),
        (4, "alltoall", 0, 3),  # the block in use, its send copy, the block being received
        (4, "alltoall", 1, 3),
        (2, "alltoall", 1, 1),  # cp 2 after step 0: nothing left to receive
    ],
)
def test_kv_blocks_in_flight_per_step(cp: int, rotate: str, step: int, blocks: int) -> None:
    """The K/V blocks each ring step holds, term by term (the peak alone hides step 0's count: issue 51's mutant
    ring-mem-allgather survived the by-hand totals)."""
    from llmctl.plan.memory.ring import kv_blocks

    assert kv_blocks(cp, rotate, step) == blocks


def test_ring_buffers_all_to_all_and_without_load_balance() -> None:
    # All-to-all: the block in use, its send copy and the block being received (3 KV), at every step from cp 3 on.
    ring = mem.ring_buffers(TINY, setup(cp_rotate="alltoall"))
    assert ring.forward_kv == ring.backward_kv == 3 * KV == 393_216
    assert ring.forward_merge == 18 * Q + 16 * LSE
    # Without the head-tail split there is no partial update: no extra accumulator copy.
    flat = mem.ring_buffers(TINY, setup(cp_load_balance=False))
    assert flat.backward_grads == 4 * Q + 24 * K + 2 * (Q + 2 * K) == 1_310_720


def test_ring_buffers_cp2_all_to_all_last_step_holds_one_block() -> None:
    # cp 2, s = 512: the second (last) step only uses the received block: 1 block, not 3.
    q, k = 1 * 8 * 512 * 32, 1 * 4 * 512 * 32
    kv, lse = 2 * k * 2, 8 * 512
    ring = mem.ring_buffers(TINY, setup(cp=2, cp_rotate="alltoall"))
    later, first = (kv, 18 * q + 16 * lse), (3 * kv, 6 * q + 4 * lse)
    assert sum(later) > sum(first)
    assert (ring.forward_kv, ring.forward_merge) == later


def test_ring_buffers_fp32_has_no_upcast_copy() -> None:
    # fp32: out.to(float32) is the output itself: 16 bytes per output element in the merge; k and v 4 bytes each.
    ring = mem.ring_buffers(TINY, setup(precision="fp32"))
    kv = 2 * K * 4
    later, first = (4 * kv, 16 * Q + 16 * LSE), (6 * kv, 4 * Q + 4 * LSE)
    assert (ring.forward_kv, ring.forward_merge) == max(later, first, key=sum)


def test_full_checkpointing_backward_holds_the_larger_ring() -> None:
    # Whole-block recompute runs the forward ring again in backward: that phase holds the larger of the two. For
    # llama-tiny's GQA (2 query heads per kv head) the backward's is larger; the forward's wins for fewer kv heads.
    ring = mem.ring_buffers(TINY, setup(checkpointing="full"))
    assert ring.backward == max(ring.forward, 524_288 + 1_572_864) and not ring.backward_is_recompute
    gqa8 = replace(
        TINY, layers=tuple(replace(la, attention=replace(la.attention, num_kv_heads=1)) for la in TINY.layers)
    )
    r8 = mem.ring_buffers(gqa8, setup(checkpointing="full"))
    assert r8.backward_is_recompute and (r8.backward_kv, r8.backward_grads) == (r8.forward_kv, r8.forward_merge)
    assert not mem.ring_buffers(gqa8, setup(checkpointing="selective")).backward_is_recompute  # output kept


# --- the estimate ------------------------------------------------------------------------------------------------------
def test_ring_lines_are_their_own_components_in_their_phases() -> None:
    est = mem.estimate(TINY, setup())
    by = {c.name: c for c in est.components}
    assert by[RING_FORWARD_KV].bytes == 524_288 and by[RING_FORWARD_KV].phases == ("forward",)
    assert by[RING_FORWARD_MERGE].bytes == 1_212_416 and by[RING_FORWARD_MERGE].phases == ("forward",)
    assert by[RING_BACKWARD_KV].bytes == 524_288 and by[RING_BACKWARD_KV].phases == ("backward",)
    assert by[RING_BACKWARD_GRADS].bytes == 1_572_864 and by[RING_BACKWARD_GRADS].phases == ("backward",)
    assert "cp 4, allgather" in by[RING_FORWARD_KV].note
    for phase, total in est.phase_bytes.items():
        assert total == sum(c.bytes for c in est.components if phase in c.phases)
    assert not any(c.name.startswith("ring") for c in mem.estimate(TINY, setup(cp=1)).components)


COPY_NOTE = "ring attention: a second attention output per layer"


def test_activations_are_those_of_s_over_cp_tokens() -> None:
    # Full checkpointing keeps each block's input: 4 layers x 256 tokens x 256 hidden x 2 bytes; plus the rotary cos
    # and sin tables of this rank's positions (1 x 256 x 32 each, bf16).
    c = comps(setup(checkpointing="full"))
    assert c["activations (block inputs, checkpointed)"] == 4 * 256 * 256 * 2 + 2 * 256 * 32 * 2 == 557_056
    # Every activation line at cp 4 is the line at cp 1 with a sequence of 1024 / 4 tokens (without the load balance,
    # whose extra output copy is checked below).
    for ck in ("none", "selective", "full", "partial:2"):
        mine = comps(setup(checkpointing=ck, loss_chunk_tokens=64, cp_load_balance=False))
        short = comps(setup(cp=1, seq_len=S // 4, checkpointing=ck, loss_chunk_tokens=64))
        for name, b in short.items():
            if not name.startswith(("parameters", "gradients", "optimizer", "bf16", "unsharded")):
                assert mine[name] == b, (ck, name)


def test_the_head_tail_split_keeps_a_second_attention_output_and_positions_have_b_rows() -> None:
    # With the load balance every cp rank but the last keeps o_proj's input as a copy of the merged output (torch.cat
    # in the ring's partial update leaves it (b, heads, s, d)-contiguous; transformers' transpose + contiguous copies
    # it): 8 heads x 32 x 256 tokens x 2 bytes per layer, b = 2 sequences here.
    copy = 2 * 256 * 8 * 32 * 2
    two = setup(micro_batch_size=2)
    c = comps(two)
    assert c[f"activations ({COPY_NOTE})"] == 4 * copy  # 4 layers, none checkpointed
    assert comps(replace(two, checkpointing="partial:2"))[f"activations ({COPY_NOTE})"] == 2 * copy  # 2 kept whole
    assert f"activations ({COPY_NOTE})" not in comps(replace(two, checkpointing="full"))
    rec, flat = (
        comps(replace(two, checkpointing="full")),
        comps(replace(two, checkpointing="full", cp_load_balance=False)),
    )
    assert rec["recomputed block (backward)"] - flat["recomputed block (backward)"] == copy  # regenerated there
    assert f"activations ({COPY_NOTE})" not in comps(replace(two, cp_load_balance=False))
    # The engine passes each sequence's positions (b rows), so the rotary tables are b x 256 x 32 (cos and sin, bf16).
    full = comps(replace(two, checkpointing="full"))
    assert full["activations (block inputs, checkpointed)"] == 4 * 2 * 256 * 256 * 2 + 2 * 2 * 256 * 32 * 2
    # The logits without chunks: this rank's 256 tokens x 320 (fp32 log-softmax).
    assert comps(setup())["loss log-softmax (fp32, b*s*V)"] == 4 * 256 * 320


def test_states_shard_over_dp_shard_times_cp() -> None:
    p = TINY.params
    # full_shard on 8 GPUs at cp 4: dp_shard 2 x cp 4 = 8 ranks, as at cp 1.
    four = comps(setup())
    assert four["optimizer states (adamw)"] == math.ceil(p * 8 / 8) == comps(setup(cp=1))["optimizer states (adamw)"]
    assert four["parameters (fp32 master, sharded)"] == math.ceil(p * 4 / 8)
    # no_shard (DDP's degrees: 2 replicas) at cp 4: FSDP2 still shards over the cp group of 4.
    ddp = comps(setup(strategy="no_shard"))
    assert ddp["optimizer states (adamw)"] == math.ceil(p * 8 / 4)
    assert ddp["unsharded layers (FSDP all-gather)"] == int(2 * TINY.params_per_layer * 2 * (1 - 1 / 4))
    # At cp 1 DDP keeps everything whole, and gathers nothing.
    assert comps(setup(cp=1, strategy="no_shard"))["optimizer states (adamw)"] == p * 8
    assert "unsharded layers (FSDP all-gather)" not in comps(setup(cp=1, strategy="no_shard"))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_memory_never_grows_with_cp(cp: int) -> None:
    for ck in ("none", "full"):
        lo = mem.estimate(TINY, setup(cp=cp, checkpointing=ck, seq_len=2048)).device_bytes
        hi = mem.estimate(TINY, setup(cp=cp // 2, checkpointing=ck, seq_len=2048)).device_bytes
        assert lo <= hi


def test_fit_report_carries_cp_and_its_ring() -> None:
    rep = mem.fit_report(TINY, setup(checkpointing="full"), None)
    assert rep["setup"]["cp"] == 4
    cp = rep["context_parallel"]
    assert cp["tokens_per_rank"] == 256 and cp["fsdp_shard"] == 8 and cp["rotate"] == "allgather"
    assert (cp["ring_forward_kv_bytes"], cp["ring_forward_merge_bytes"]) == (524_288, 1_212_416)
    assert cp["activations_bytes"] < cp["activations_at_cp1_bytes"]
    assert "context_parallel" not in mem.fit_report(TINY, setup(cp=1), None)
    # The activation terms of one block are this rank's 256 tokens'.
    terms = rep["layer_activation_terms"]
    assert terms["attention logsumexp"] == 4 * 8 * 256
