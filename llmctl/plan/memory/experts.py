"""Expert parallelism's model states (torch-free): what one GPU keeps of the routed experts at ep > 1.

At ep > 1 (llmctl.spec.experts: torchtitan's layout) each MoE layer's routed experts are split by expert index over
the ep ranks and FSDP-shards each rank's E/ep local experts over the `expert_shard` ("efsdp") ranks, so a rank stores
ExpertShare.param_fraction = 1 / (ep x efsdp) of them; everything else (attention, norms, the router, shared experts,
embeddings, head) stays sharded over dp_shard x cp as at ep 1. What ep changes on a GPU:
- the states at rest: 1/(ep x efsdp) = 1/(dp_shard x cp) of the experts under FSDP2, the same bytes as at ep 1; under
  the zero engine the lines a ZeRO stage does not shard keep E/ep experts instead of E;
- FSDP's all-gather of a layer in flight (and under pp the rank's parameters and gradients kept unsharded until the
  schedule's end): the experts' group unshards to E/ep experts, not E: where ep saves memory;
- one layer's unsharded gradients for the reduce-scatter: E/ep experts.
Activations (the second half): what the engine's dispatch keeps per MoE layer (llmctl.engine.experts), counted as its
difference from the ep 1 experts' loop that llmctl.plan.memory.activations sizes, and one layer's dispatch buffers.
At ep 1 nothing here is asked: the callers keep their ep 1 arithmetic bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import llmctl.plan.memory.pipeline as pl
from llmctl.plan.memory.ledger import state_shard_degree
from llmctl.plan.memory.states import state_ledger
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.experts import IMBALANCE, ExpertShare, dispatch_rows, share
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import TrainSetup


@lru_cache(maxsize=4096)
def layer_expert_params(layer: Layer, hidden_size: int) -> int:
    """Parameters of one block's routed experts (its 3-D expert tensors and their biases; 0 for a dense block).
    Cached as llmctl.spec.layers.layer_params is: the planner asks for every block of every setup it sizes."""
    if not layer.mlp.moe:
        return 0
    prefix = f"mlp.{layer.mlp.names[1]}."
    return sum(math.prod(s) for n, s in layer.tensors(hidden_size) if n.startswith(prefix))


def experts_split_by_tp(setup: TrainSetup) -> int:
    """Ways tensor parallelism splits the routed experts: none in llmctl's engine (a MoE block stays whole under tp:
    llmctl.plan.memory.pipeline.tp_block_params), tp under the zero engine (Megatron's expert tensor parallelism)."""
    return 1 if setup.engine == "fsdp2" else setup.dims.rank_shard(setup.seq_len).tensor_ranks


def held_expert_params(spec: ModelSpec, setup: TrainSetup, blocks: Iterable[int] | None = None) -> float:
    """Routed-expert parameters of the blocks (every block: None) on one GPU after the tp split, before ep and FSDP."""
    if spec.measured is not None:
        return 0.0
    h = spec.hidden_size
    idx = range(spec.num_layers) if blocks is None else blocks
    return sum(layer_expert_params(spec.layers[i], h) for i in idx) / experts_split_by_tp(setup)


def ep_share(spec: ModelSpec, setup: TrainSetup) -> ExpertShare:
    """One rank's part of each MoE layer (llmctl.spec.experts): E, ep and the efsdp ranks."""
    experts = max((la.mlp.num_experts for la, _ in spec.layer_groups), default=0)
    return share(experts, setup.ep, setup.dims.expert_shard)


def expert_fraction(setup: TrainSetup, degree: int) -> float:
    """Of the held routed experts, what one rank keeps of a state split over `degree` ranks at ep: the dp_shard x cp
    ranks (every FSDP2 state, ZeRO's sharded lines) split them as ep x efsdp (ExpertShare.param_fraction); a state
    no stage shards (degree 1) keeps the rank's E/ep experts whole."""
    if degree == setup.dims.fsdp_shard:
        return share(setup.ep, setup.ep, setup.dims.expert_shard).param_fraction
    return 1.0 / (setup.ep * degree)


def local_layer_params(spec: ModelSpec, setup: TrainSetup, layer_params: float) -> float:
    """The largest block's parameters as one GPU unshards them: `layer_params` (the ep 1 figure) at ep 1; at ep > 1
    its exact tp split (llmctl.plan.memory.pipeline.tp_block_params: the experts whole under tp in llmctl's engine)
    with the routed experts at E/ep."""
    if setup.ep == 1:
        return layer_params
    return largest_layer_params(spec, setup) - largest_layer_expert_params(spec, setup) * (1 - 1 / setup.ep)


def _largest_layer(spec: ModelSpec) -> Layer:
    """The block with the most parameters (what FSDP gathers at once: ModelSpec.params_per_layer's)."""
    return max((la for la, _ in spec.layer_groups), key=spec.params_of)


def largest_layer_params(spec: ModelSpec, setup: TrainSetup) -> float:
    """The largest block's parameters on one GPU after the tp split."""
    return pl.tp_block_params(spec, setup, _largest_layer(spec))


def largest_layer_expert_params(spec: ModelSpec, setup: TrainSetup) -> float:
    """The routed experts of the largest block on one GPU after the tp split (0: dense, or measured on fake tensors)."""
    if spec.measured is not None:
        return 0.0
    return layer_expert_params(_largest_layer(spec), spec.hidden_size) / experts_split_by_tp(setup)


def gathered_layer_bytes(spec: ModelSpec, setup: TrainSetup) -> float:
    """What FSDP's all-gather of the largest block adds on one rank at ep > 1 (the ep 1 line's form: the gathered
    layer less the rank's own shard): its dense part over dp_shard x cp, its E/ep local experts over efsdp (whole
    when efsdp is 1: the experts' group is not sharded, its compute-dtype copy is the rank's experts cast)."""
    fsdp, efsdp = setup.dims.fsdp_shard, setup.dims.expert_shard
    routed = largest_layer_expert_params(spec, setup)
    dense = (largest_layer_params(spec, setup) - routed) * (1 - 1 / fsdp)
    local = routed / setup.ep * ((1 - 1 / efsdp) if efsdp > 1 else 1.0)
    return (dense + local) * setup.compute_bytes


def local_held_params(spec: ModelSpec, setup: TrainSetup, held: float, blocks: Iterable[int] | None = None) -> float:
    """Parameters one ep rank holds unsharded (`held`: the GPU's after the tp split at ep 1): the experts at E/ep."""
    if setup.ep == 1:
        return held
    return held - held_expert_params(spec, setup, blocks) * (1 - 1 / setup.ep)


@dataclass(frozen=True)
class ExpertMemory:
    """The routed experts' bytes on one GPU at a setup, what the planner's explanation quotes ("EP 8: experts 7.9 GiB
    per GPU instead of 63")."""

    ep: int
    local_experts: int
    experts: int
    params: float
    """Routed-expert parameters one GPU holds after the tp split, before ep and FSDP (all of its pp rank's layers)."""
    states_bytes: int
    """The ledger's lines for them at rest: parameters, gradients, optimizer states."""
    unsharded_bytes: int
    """Their unsharded copies at the peak: FSDP's gathered layers in flight (under pp the rank's parameters and
    gradients kept whole until the schedule's end), the reduce-scatter's gradients."""

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + self.unsharded_bytes


def expert_memory(spec: ModelSpec, setup: TrainSetup) -> ExpertMemory:
    """The routed experts' bytes on one GPU (the pp rank holding the most under pp): their states at rest and their
    unsharded copies at the peak, as the estimate counts them (llmctl.plan.memory.estimate). At ep 1 the same
    arithmetic with E experts per rank: what the planner's explanation compares ep > 1 with."""
    ranks = pl.pipeline_ranks(spec, setup) if setup.pp > 1 else (None,)
    return max((_rank_expert_memory(spec, setup, r) for r in ranks), key=lambda m: m.total_bytes)


def _rank_expert_memory(spec: ModelSpec, setup: TrainSetup, prank: pl.PipelineRank | None) -> ExpertMemory:
    held = held_expert_params(spec, setup, prank.blocks if prank else None)
    states = sum(
        held * line.bytes_per_param * expert_fraction(setup, state_shard_degree(setup, line))
        for line in state_ledger(spec, setup)
        if line.params is None  # adapters' lines count adapter parameters (adapters keep ep 1)
    )
    sh = ep_share(spec, setup)
    return ExpertMemory(
        ep=setup.ep,
        local_experts=sh.local_experts,
        experts=sh.experts,
        params=held,
        states_bytes=math.ceil(states),
        unsharded_bytes=int(_unsharded_expert_bytes(spec, setup, held, prank)),
    )


def _unsharded_expert_bytes(spec: ModelSpec, setup: TrainSetup, held: float, prank: pl.PipelineRank | None) -> float:
    """The experts' unsharded copies at the peak: under pp (FSDP2) the rank's E/ep experts whole in the compute dtype
    and their gradients in the reduce dtype; else FSDP's gathered layers in flight (two, every layer under
    SHARD_GRAD_OP) and one layer's gradients for the reduce-scatter."""
    cb, p, dims = setup.compute_bytes, setup.precision, setup.dims
    if not held:
        return 0.0
    if prank is not None and setup.engine == "fsdp2":
        grads = (p.reduce_bytes if p.reduce_dtype != p.compute_dtype else cb) if setup.training else 0
        return held / setup.ep * (cb + grads)
    layer = largest_layer_expert_params(spec, setup) / setup.ep
    if setup.engine != "fsdp2" and dims.zero_stage < 3:
        return 0.0
    blocks = len(prank.blocks) if prank else spec.num_layers
    n_layers = blocks if dims.zero_stage == 2 else min(2, blocks)
    efsdp = dims.expert_shard
    gathered = n_layers * layer * cb * ((1 - 1 / efsdp) if efsdp > 1 else 1.0)
    grads = layer * (cb + 4 if cb != 4 else 4) if setup.training and dims.fsdp_shard > 1 else 0.0
    return gathered + grads


# --- activations at ep > 1: what llmctl.engine.experts.dispatch_forward keeps --------------------------------------
EP_SAVED = "activations (ep dispatch, over the ep 1 loop)"
EP_BUFFERS = "ep: one MoE layer's all-to-all buffers"
IMBALANCE_NOTE = f"dropless, balanced routing assumed (imbalance {IMBALANCE:.1f})"


def dispatch_saved_bytes(spec: ModelSpec, layer: Layer, tokens: int, ep: int, ab: int) -> int:
    """What one MoE layer's experts keep for backward on one rank at ep > 1 (llmctl.engine.experts.dispatch_forward,
    autograd's saved tensors), `tokens` its tokens, `ab` the compute dtype's bytes. Per row it sends (tokens x k):
    the sort's index `order // k` and the combine's reorder `argsort(order)` (int64 each, kept by the two
    index ops), the combined rows (kept by the multiply with the routing weights) and the weights (a compute-dtype
    view of the router's scores, kept by the same multiply). Per row it receives (llmctl.spec.experts.dispatch_rows
    at IMBALANCE): the regroup `by_expert` and its inverse (int64, the index ops'), the rows (the gate_up grouped
    GEMM's input), gate_up's output, the activation's output and the product (down's input): glu x i wide as the
    ep 1 path keeps them (gpt-oss's clamped GLU: 7), and with expert biases their row ids (int64); the grouped
    GEMMs' offsets (int32, one per local expert). The all-to-alls keep nothing (their backward is the reverse
    all-to-all)."""
    m, h = layer.mlp, spec.hidden_size
    k, i = m.experts_per_token, m.intermediate_size
    glu = 7 if m.act == "swiglu-clamped" else 4
    _, received = dispatch_rows(tokens, k, ep, IMBALANCE)
    send = tokens * k * (ab * h + ab + 16)
    recv = received * (ab * (h + glu * i) + 16 + (8 if m.expert_bias else 0))
    return int(send + recv) + 4 * (m.num_experts // ep)


def loop_saved_bytes(spec: ModelSpec, layer: Layer, tokens: int, ab: int) -> int:
    """What the ep 1 path keeps of the same rows (llmctl.plan.memory.activations' "moe dispatched tokens": per (token,
    expert) row the gathered input, glu x i wide internals, the down output, an fp32 routing weight and three int64
    indices, four with biases)."""
    m, h = layer.mlp, spec.hidden_size
    glu = 7 if m.act == "swiglu-clamped" else 4
    return (
        m.experts_per_token * tokens * (ab * (2 * h + glu * m.intermediate_size) + 4 + 8 * (4 if m.expert_bias else 3))
    )


def dispatches(spec: ModelSpec, layer: Layer) -> bool:
    """Whether the engine dispatches this block's experts at ep > 1 (llmctl.engine.experts.is_experts: top-k routed
    experts; Llama 4's every-token experts and a model measured on fake tensors are not counted here)."""
    return layer.mlp.moe and not spec.features.dense_moe and spec.measured is None


def saved_delta_bytes(spec: ModelSpec, setup: TrainSetup, layer: Layer, tokens: int) -> int:
    """One MoE layer's saved bytes at the setup's ep less the ep 1 path's (0 at ep 1, for a dense block, or where the
    engine does not dispatch)."""
    if setup.ep == 1 or not dispatches(spec, layer):
        return 0
    ab = setup.compute_bytes
    return dispatch_saved_bytes(spec, layer, tokens, setup.ep, ab) - loop_saved_bytes(spec, layer, tokens, ab)


def stage_saved_delta(spec: ModelSpec, setup: TrainSetup, blocks: Iterable[int], tokens: int) -> int:
    """saved_delta_bytes over the blocks of one stage (every block at pp 1) that keep their forward's tensors whole
    (no checkpointing; partial:K's others). Full and selective checkpointing keep none (selective's op policy saves
    matmul outputs: the dispatch's are not counted)."""
    blocks = list(blocks)
    ck = setup.checkpointing
    if ck not in ("none",) and not ckpt_modes.partial_every(ck):
        return 0
    checkpointed = set(ckpt_modes.whole_layers(ck, len(blocks)))
    return sum(
        saved_delta_bytes(spec, setup, spec.layers[b], tokens) for n, b in enumerate(blocks) if n not in checkpointed
    )


def buffer_bytes(spec: ModelSpec, setup: TrainSetup, tokens: int) -> int:
    """One MoE layer's dispatch in flight (forward; the gradients' all-to-alls in backward are as large): the sorted
    copy of the rows it sends (tokens x k x hidden) and the rows it receives, in the compute dtype."""
    if setup.ep == 1:
        return 0
    most = 0
    for la, _ in spec.layer_groups:
        if dispatches(spec, la):
            k = la.mlp.experts_per_token
            _, received = dispatch_rows(tokens, k, setup.ep, IMBALANCE)
            most = max(most, int(setup.compute_bytes * spec.hidden_size * (tokens * k + received)))
    return most
