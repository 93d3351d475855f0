"""Pipeline parallelism's cost terms (torch-free): what the heaviest pp rank runs, the idle time of its schedule, and
the activations its stages send each other.

- The stages: llmctl.spec.pipeline.split_layers (torchtitan's split) and stages_of_rank (loop and V placement). A
  rank runs the blocks of its stages, the token embedding on stage 0 and the final norm + LM head on the last stage.
  The pipeline moves at the pace of its slowest rank: `heaviest_rank` is the rank with the most matmul FLOPs, and the
  step's compute is that rank's (its share of the model's micro-batch times, `RankShare`).
- The bubble (`bubble`): GPipe and 1F1B (p - 1) / m, interleaved 1F1B (p - 1) / (v m) (Narayanan et al. 2021,
  arXiv 2104.04473 eq. 1 and section 2.2.1), through llmctl.spec.pipeline.bubble_fraction; ZB-V (Qi et al. 2024,
  "Zero Bubble Pipeline Parallelism", arXiv 2401.10241 section 6) idles (p - 1)(T_F + T_B - 2 T_W) per schedule run,
  T_F, T_B and T_W the forward, input-gradient and weight-gradient times of one stage (half a rank's: two stages a
  rank in the V). The weight gradient of a matmul costs its forward (2 FLOPs a weight a token, as the input
  gradient), so T_W is the forward matmul time; attention, memory-bound ops and recompute are input-gradient work.
- Point-to-point sends (`p2p_comm`): each stage boundary sends one micro-batch's activation forward and its gradient
  back, micro_batch x seq/cp x hidden x compute bytes each (what torchtitan's stages pass: the residual stream);
  a rank runs v stages, so v sends each way per micro-batch. Ranks pp-adjacent are world/pp (= tp x cp x dp) ranks
  apart (pp outermost in the mesh, llmctl.spec.parallel): a hop stays inside a node only while two consecutive
  stages' ranks share one (`hops`); the pipeline runs at its slowest hop. The link's rate is
  llmctl.plan.network.p2p_bandwidth's. Exposed: the fill and the drain (the first micro-batch's forward and the last
  one's backward walk the p - 1 hops with nothing to hide behind) and (1 - overlap) of the steady state's sends
  (torch.distributed.pipelining posts them as isend/irecv beside the next micro-batch's compute: the same stated
  overlap as FSDP's).
- FSDP under pp (torch.distributed.pipelining.stage, backward_maybe_with_nosync; torchtitan does not reshard after
  forward under PP): a stage's parameters are gathered once per schedule run and its gradients reduce-scattered at
  the run's last backward (llmctl.plan.comm.step_comm, `pipelined`), over the smaller FSDP group a stage has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmctl.plan import comm as cm
from llmctl.plan import flops as fl
from llmctl.plan.network import p2p_bandwidth
from llmctl.spec import pipeline
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import ParallelDims
from llmctl.spec.pipeline import Schedule
from llmctl.spec.setup import TrainSetup


@dataclass(frozen=True)
class RankShare:
    """What one pp rank runs of the model: its blocks, the embedding and head if its stages hold them, and its
    shares of the model's matmul FLOPs, attention FLOPs and parameters (each 1 at pp = 1)."""

    rank: int
    blocks: tuple[int, ...]
    embedding: bool
    head: bool
    matmul: float
    attention: float
    params: float
    """Fraction of the model's parameters (spec.params) the rank holds (a tied embedding: on both ends)."""

    @property
    def layers(self) -> int:
        """FSDP units the rank gathers: its blocks (at least one: an end stage of the embedding or head alone)."""
        return max(1, len(self.blocks))


WHOLE = RankShare(0, (), True, True, 1.0, 1.0, 1.0)


def _block_weights(spec: ModelSpec, seq_len: int) -> tuple[list[float], list[float], list[float]]:
    """Per block: matmul FLOPs per token (2 x weights a token passes through), attention FLOPs per token, and
    parameters."""
    h = spec.hidden_size
    mm, attn, params = [], [], []
    for layer in spec.layers:
        mm.append(2 * sum(i * o for _, i, o in fl.layer_matmuls(spec, layer)))
        at = layer.attention
        attn.append(2 * at.num_heads * at.span(seq_len) * (at.head_dim + at.v_head_dim))
        if spec.measured is not None:
            params.append(mm[-1] / 2)
        else:
            params.append(sum(math.prod(shape) for _, shape in layer.tensors(h)))
    return mm, attn, params


def rank_share(spec: ModelSpec, setup: TrainSetup, rank: int) -> RankShare:
    """Rank `rank`'s share of the model under the setup's pipeline (module docstring)."""
    sched, pp, v = setup.pp_schedule, setup.pp, setup.virtual_stages
    parts = pipeline.split_layers(spec.num_layers, pp * v)
    mm, attn, params = fl._memo(spec, ("pp_blocks", setup.seq_len), lambda: _block_weights(spec, setup.seq_len))
    head_mm = 2 * spec.hidden_size * spec.vocab_size
    emb = spec.vocab_size * spec.hidden_size
    mine = [parts[s] for s in pipeline.stages_of_rank(sched, rank, pp, v)]
    blocks = tuple(b for p in mine for b in p.blocks)
    has_emb, has_head = any(p.embedding for p in mine), any(p.head for p in mine)
    total_mm = sum(mm) + head_mm
    total_params = sum(params) + emb + (0 if spec.tie_embeddings else emb)
    own_mm = sum(mm[b] for b in blocks) + (head_mm if has_head else 0)
    own_params = sum(params[b] for b in blocks) + (emb if has_emb else 0) + (emb if has_head else 0)
    if has_head and has_emb and spec.tie_embeddings:
        own_params -= emb
    return RankShare(
        rank,
        blocks,
        has_emb,
        has_head,
        own_mm / total_mm,
        sum(attn[b] for b in blocks) / (sum(attn) or 1.0),
        own_params / total_params,
    )


def heaviest_rank(spec: ModelSpec, setup: TrainSetup) -> RankShare:
    """The pp rank with the most matmul FLOPs (the one the pipeline waits for); WHOLE at pp = 1."""
    if setup.pp == 1:
        return WHOLE
    key = ("pp_heaviest", setup.seq_len, setup.pp, setup.pp_schedule, setup.virtual_stages)
    return fl._memo(
        spec,
        key,
        lambda: max(
            (rank_share(spec, setup, r) for r in range(setup.pp)), key=lambda s: (s.matmul + s.attention, s.params)
        ),
    )


def bubble(sched: Schedule, pp: int, microbatches: int, virtual: int, f_s: float, b_s: float, w_s: float) -> float:
    """Idle time of a schedule run over its ideal compute (module docstring). f_s, b_s, w_s: one micro-batch's
    forward, whole backward and weight-gradient seconds on the rank (all its stages). ZB-V: the paper's idle time
    (p - 1)(T_F + T_B - 2 T_W) with each stage's half of the rank's times, over the run's m (f + b); never below 0."""
    if pp == 1:
        return 0.0
    if sched is Schedule.ZBV:
        tf, tw = f_s / 2, w_s / 2
        tb = b_s / 2 - tw
        idle = max(0.0, (pp - 1) * (tf + tb - 2 * tw))
        return idle / (microbatches * (f_s + b_s)) if f_s + b_s > 0 else 0.0
    return pipeline.bubble_fraction(sched, pp, microbatches, virtual)


def hops(dims: ParallelDims, gpus_per_node: int) -> tuple[int, int]:
    """(hops inside a node, hops between nodes) of the pp - 1 between consecutive stages' ranks: stage r's ranks are
    [r x stride, (r + 1) x stride) with stride = world / pp; a hop stays in a node when both stages' ranks do."""
    stride = dims.world_size // dims.pp
    inside = sum(
        1 for r in range(dims.pp - 1) if (r * stride) // gpus_per_node == ((r + 2) * stride - 1) // gpus_per_node
    )
    return inside, dims.pp - 1 - inside


def activation_bytes(setup: TrainSetup, hidden: int) -> float:
    """Bytes one stage boundary sends per micro-batch each way: micro_batch x seq/cp x hidden x compute bytes."""
    return setup.micro_batch_size * setup.dims.rank_shard(setup.seq_len).tokens * hidden * setup.compute_bytes


def p2p_comm(setup: TrainSetup, hidden: int, net: cm.Network, overlap: float) -> cm.StepComm:
    """The pipeline's point-to-point sends per optimizer step on the busiest rank (module docstring); none at
    pp = 1."""
    if setup.pp == 1:
        return cm.StepComm(ops=[], total_s=0.0, exposed_s=0.0, bottleneck="")
    g = setup.gpus_per_node
    _, across = hops(setup.dims, g)
    scope = "inter" if across else "intra"
    size = activation_bytes(setup, hidden)
    bw = p2p_bandwidth(net, scope, size, g)
    per_send = net.alpha(scope) + size / (bw * 1e9)
    runs = setup.grad_accum_steps // setup.pipeline_microbatches
    sends = 2 * setup.virtual_stages * setup.grad_accum_steps  # forward and backward, each of the rank's stages
    fill = runs * 2 * (setup.pp - 1) * per_send  # the first forward and the last backward walk the hops
    total = sends * per_send
    exposed = min(total, fill + (1 - overlap) * max(0.0, total - fill))
    where = "inter-node" if across else "intra-node"
    op = cm.CommOp(f"pipeline send/recv ({where})", "send_recv", scope, 2, size, sends, "p2p", bw, per_send)
    return cm.StepComm(ops=[op], total_s=total, exposed_s=exposed, bottleneck=f"{op.name} at {bw:.3g} GB/s")
