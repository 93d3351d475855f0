"""Context parallelism's communication: ring attention's key/value exchanges per layer, and how much of them the
attention compute hides (torch-free).

What moves (torch's ring attention, torch.distributed.tensor.experimental `_context_parallel/_attention.py`, the code
the engine runs; llmctl.plan.memory.ring sizes its buffers). Per layer and micro-batch, one rank of a cp group with
b sequences of s = S/cp tokens, kv of its key/value heads (divided by tp), head size d, compute dtype of ab bytes:

    KV  = 2 b kv s d ab   bytes: its keys and values, concatenated (`torch.cat([key.flatten(), value.flatten()])`)
    dKV = 2 b kv s d 4    bytes: their gradients, accumulated in fp32 (`convert_to_f32`)

- forward: every rank needs every other rank's K/V: with the all-gather rotation one all-gather of the cp blocks
  (nccl-tests' S = cp KV, bus factor (cp-1)/cp: (cp-1) KV through each link), started before the first step and
  waited for at the second; with the all-to-all rotation cp-1 hops of KV to the next rank (`permute_tensor`, timed as
  nccl-tests' sendrecv: bus factor 1, one latency step), hop i+1 started before step i's attention.
- backward: the K/V again (the same rotation), and the dK/dV accumulators, which always go round hop by hop
  (`method=ALL_TO_ALL`): after each of the cp steps (the last hop brings each rank its own keys' gradients home),
  hop i waited for after step i+1's attention.
- whole-block checkpointing (full, partial) re-runs the forward, ring and all, in the backward of each recomputed
  layer; selective keeps the attention output and does not.

Overlap, stated: a transfer runs on its own stream while the attention of the step it was started before computes,
so per ring step exposed = max(0, what is in flight - that step's attention time), and a step's attention time is
this rank's attention (forward or backward) of the layer over cp steps. Forward: steps 0..cp-2 each carry one hop
(all-to-all), or step 0 carries the whole all-gather. Backward: step i carries the K/V of step i+1 (as forward) and
the dK/dV hop of step i-1 (i >= 1); the last dK/dV hop has no attention after it and is exposed whole. Not modelled:
the matmuls around attention (the transfers could hide behind them too; not counted, so the exposure is an upper
bound), contention with FSDP's and TP's collectives on the same links, and the load-unbalanced ring's uneven steps
(each step is taken as 1/cp of the slowest rank's attention; its full blocks are slightly longer).

The group: cp ranks at stride tp (torchtitan's mesh (dp_replicate, dp_shard, cp, tp)), inside one node when
cp x tp divides the GPUs per node; else its hops between nodes run at one GPU's share of the node's NICs (send/recv)
and its all-gather as a ring across nodes shared by the tp groups side by side (llmctl.plan.comm).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.plan import comm as cm
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import TrainSetup


@dataclass(frozen=True)
class RingLayer:
    """One kind of decoder layer as the ring sees it, per micro-batch on one rank."""

    count: int
    recomputed: int
    kv_bytes: float
    """This rank's keys and values (KV)."""
    attn_fwd_s: float
    """This rank's attention (QK^T and AV) forward seconds for the layer; backward is twice it."""


def ring_layers(
    spec: ModelSpec, setup: TrainSetup, rate_flops_s: float, blocks: tuple[int, ...] | None = None
) -> list[RingLayer]:
    """The layer kinds of `spec` on one rank of the setup's cp group, at `rate_flops_s` achieved FLOP/s; `blocks`: the
    blocks a pp rank holds (None: all)."""
    b, cp, tp = setup.micro_batch_size, setup.cp, setup.tp
    s = setup.seq_len // cp
    imbalance = setup.dims.attention_imbalance(setup.cp_load_balance)
    recomputed: dict[Layer, int] = {}
    if setup.checkpointing != "selective":
        for i in ckpt_modes.whole_layers(setup.checkpointing, spec.num_layers):
            if blocks is None or i in blocks:
                recomputed[spec.layers[i]] = recomputed.get(spec.layers[i], 0) + 1
    groups = spec.groups_of(blocks)  # a pipeline rank's blocks only, or all
    out = []
    for layer, n in groups:
        at = layer.attention
        kv = 2 * b * -(-at.num_kv_heads // tp) * s * at.head_dim * setup.compute_bytes
        # QK^T and AV forward over the whole sequence's keys (PaLM's convention, llmctl.plan.flops), this rank's
        # 1/cp of the queries (x the imbalance) and 1/tp of the heads.
        flops = b * setup.seq_len * 2 * at.num_heads * at.span(setup.seq_len) * (at.head_dim + at.v_head_dim)
        out.append(RingLayer(n, recomputed.get(layer, 0), kv, flops * imbalance / cp / tp / rate_flops_s))
    return out


def _over(t: float, step_s: float) -> float:
    """What one ring step's attention does not hide of `t` seconds in flight beside it."""
    return max(0.0, t - step_s)


def ring_step_comm(
    layers: list[RingLayer], setup: TrainSetup, net: cm.Network, gpus_per_node: int | None = None
) -> cm.StepComm:
    """Ring attention's communication per optimizer step: its ops and what the attention compute does not hide
    (module docstring). None at cp = 1."""
    cp, tp, accum = setup.cp, setup.tp, setup.grad_accum_steps
    if cp <= 1 or not layers:
        return cm.StepComm(ops=[], total_s=0.0, exposed_s=0.0, bottleneck="")
    g = gpus_per_node or setup.gpus_per_node
    scope = "intra" if g % (cp * tp) == 0 else "cross"
    alpha = net.alpha(scope)

    def busbw(collective: str, size: float) -> float:
        bw = net.busbw(collective, scope, size, g)
        if collective == "all_gather" and scope == "cross" and tp > 1 and net.inter_node_gbytes_s:
            bw = min(bw, net.inter_node_gbytes_s / tp)  # the tp rings side by side share each node's NICs
        return bw

    gather = setup.cp_rotate == "allgather"
    ops: dict[tuple[str, float], cm.CommOp] = {}
    exposed = 0.0

    def add(name: str, collective: str, size: float, calls: int) -> float:
        """One call's seconds; the calls per step of an op (a name and size) accumulate over the layer kinds."""
        bw = busbw(collective, size)
        t = cm.collective_time_s(collective, cp, size, bw, alpha)
        prev = ops.get((name, size))
        total_calls = calls * accum + (prev.calls_per_step if prev else 0)
        ops[(name, size)] = cm.CommOp(name, collective, scope, cp, size, total_calls, "cp", bw, t)
        return t

    for la in layers:
        step_f, step_b = la.attn_fwd_s / cp, 2 * la.attn_fwd_s / cp
        dkv = la.kv_bytes * 4 / setup.compute_bytes
        t_d = add("CP dK/dV send/recv (backward)", "send_recv", dkv, la.count * cp)
        for phase, n in (("forward", la.count), ("backward", la.count), ("recompute", la.recomputed)):
            if n == 0:
                continue
            # Steps 0 .. cp-1 (module docstring): what is in flight beside each step's attention.
            if gather:  # one all-gather, started before step 0 and waited for at step 1
                t_kv = add(f"CP K/V all-gather ({phase})", "all_gather", cp * la.kv_bytes, n)
                if phase == "backward":  # step 0: the all-gather; steps 1 .. cp-1: the dK/dV hop of the step before
                    per_layer = _over(t_kv, step_b) + (cp - 1) * _over(t_d, step_b)
                else:
                    per_layer = _over(t_kv, step_f)
            else:  # hop i+1 started before step i: steps 0 .. cp-2
                t_kv = add(f"CP K/V send/recv ({phase})", "send_recv", la.kv_bytes, n * (cp - 1))
                if phase == "backward":  # step 0: a K/V hop; 1 .. cp-2: a K/V and a dK/dV hop; cp-1: a dK/dV hop
                    per_layer = _over(t_kv, step_b) + (cp - 2) * _over(t_kv + t_d, step_b) + _over(t_d, step_b)
                else:
                    per_layer = (cp - 1) * _over(t_kv, step_f)
            if phase == "backward":
                per_layer += t_d  # the last dK/dV hop, after the last step: nothing left to hide it
            exposed += n * per_layer
    op_list = list(ops.values())
    total = sum(o.time_per_step_s for o in op_list)
    top = max(op_list, key=lambda o: o.time_per_step_s)
    return cm.StepComm(op_list, total, exposed * accum, f"{top.name} at {top.busbw_gbytes_s:.3g} GB/s")
