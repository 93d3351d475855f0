"""Communication model: alpha-beta collective times and the bytes each sharding strategy moves per step.

Torch-free, pure functions. Conventions are nccl-tests' (NVIDIA/nccl-tests doc/PERFORMANCE.md):
- algbw = S / t, busbw = algbw x factor, factor (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce.
  S is the all-gather *output*, the reduce-scatter *input* and the all-reduce buffer. busbw is what a link sustains,
  so a collective over n ranks takes  t = alpha x steps + S x factor / busbw  (ring: n-1 steps; all-reduce: the
  fewer of a ring's 2(n-1) and a tree's 2 log2 n).
- A ring that spans nodes crosses each node's NICs once per direction, so its busbw is bounded by the slowest link
  on the ring: min(intra-node busbw, the node's aggregate inter-node bandwidth). The node's GPUs share that NIC
  bandwidth; nccl-tests shows exactly this (a 2-node all-gather's busbw is about the node's NIC rate).
- HYBRID's cross-node all-reduce runs one group per local rank (G concurrent rings, one GPU per node each): each
  ring gets 1/G of the node's inter-node bandwidth and moves 1/G of the gradients. Likewise k concurrent groups with
  several ranks on each node (FSDP's shard groups beside tensor parallelism: k = tp) share the node's NICs:
  busbw = min(intra-node busbw, node bandwidth / k).

Per mesh axis (llmctl.spec.parallel.ParallelDims) and per optimizer step (FSDP, one collective per decoder layer,
Zhao et al. 2023 "PyTorch FSDP", arXiv:2304.11277):
- dp_shard (S ranks): per micro-batch, all-gather the bf16 parameters in forward AND again in backward, and
  reduce-scatter the gradients (in the reduce dtype), over the S ranks of the shard group.
- dp_replicate (R groups): one all-reduce of the local gradient shard (1/S of the gradients) across the R replicas
  per optimizer step (during the last micro-batch's backward).
So FULL_SHARD (1, N) moves only the first, NO_SHARD/DDP (N, 1) only the second, HYBRID_SHARD (nodes, G) both; where
each group runs (inside a node, one rank per node, or a ring across nodes) comes from the degrees' layout. Under
pipeline parallelism a stage is gathered once per schedule run and reduced at the run's last backward (`step_comm`,
`pipelined`); the sends between stages are llmctl.plan.stages'.

Overlap: FSDP prefetches the next layer's all-gather during the current layer's compute and reduce-scatters during
backward. `overlap` is the fraction of the overlappable time that is really hidden (a stated parameter):
exposed = comm - overlap x min(comm, compute window). Forward-phase collectives hide behind forward compute only,
backward-phase ones behind backward compute only.

With tensor parallelism (tp ranks, consecutive inside a node) FSDP runs on the data-parallel axes only and gathers
1/tp of each layer's split parameters (the parts a tp group replicates, norms and MoE blocks, whole). TP with sequence
parallelism (Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.2; llmctl.engine.tensor_parallel) moves the
activation A = b x s x h in the compute dtype, per micro-batch (`tp_calls`, `tp_step_comm`):
- a decoder layer, forward: all-gather before attention and before the MLP, reduce-scatter after o_proj and after
  down_proj; backward the mirror (2 reduce-scatters + 2 all-gathers). A mixture-of-experts block is replicated over
  the tp group (its input all-gathered, its output cut back to the sequence shard locally): forward AG, RS, AG;
  backward AG (the cut's gradient), AG, RS.
- recompute (activation checkpointing re-runs a layer's forward in backward): the all-gathers and the attention's
  reduce-scatter again; the MLP's reduce-scatter makes the layer's output, which no backward op reads, and
  non-reentrant checkpointing stops recomputing once the last tensor saved for backward is regenerated
  (torch/utils/checkpoint.py, early stop, on by default), unless a norm reads it inside the layer (Gemma's
  post-feed-forward norm). The engine's selective policy keeps no collective output (llmctl.engine.parallelize
  _sac_save_ops; torchtitan keeps reduce_scatter_tensor), so selective re-runs them in every layer.
- the embedding (split by vocabulary rows): an all-reduce of A in forward, an all-gather of its gradient in backward
  (the first layer's Replicate -> Shard(1) cut); the LM head (split by vocabulary): an all-gather of its input in
  forward, a reduce-scatter of the gradient in backward. loss_parallel's all-reduces move b x s scalars (max,
  sum of exponentials, target logit): ignored.
The group is inside one node, so every TP collective runs at the intra-node busbw. They sit on the critical path
(never hidden, `overlap` does not apply), except with async TP (torch's micro-pipelining of all-gather -> matmul and
matmul -> reduce-scatter, CUDA with compile): the matmul is cut into tp chunks and each chunk's transfer runs
behind another chunk's matmul, so exposed = max(comm / tp, comm - matmul) per pair: one chunk of tp has nothing to
hide behind (the pipeline's fill or drain), the rest hides as long as the matmul lasts. An assumption beyond that:
no slowdown of the chunked matmuls or of the copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmctl.errors import InputError

# The collectives, their nccl-tests bus factors and latency steps: one registry, shared with bench-net.
from llmctl.spec.collectives import bus_factor, ring_steps
from llmctl.spec.parallel import ParallelDims

# Fraction of a link's nominal rate that NCCL reaches as busbw at FSDP bucket sizes (16-64 MiB). nccl-tests on a
# DGX A100 reports ~230-240 GB/s all-gather busbw on 300 GB/s NVLink3 (~0.8); on NICs NCCL reaches ~80-95% of the
# line rate with RDMA and less over TCP. Used only when no bench-net measurement is given.
DEFAULT_LINK_EFFICIENCY = 0.8
# Per-step latency of a ring collective (the alpha of alpha-beta): small-message nccl-tests times are ~10-20 us for
# an 8-GPU NVLink all-reduce (14 ring steps -> ~1-2 us per step) and ~5-10 us per hop across an IB/RoCE network.
DEFAULT_ALPHA_INTRA_S = 2e-6
DEFAULT_ALPHA_INTER_S = 8e-6
# Stated default for how much of the overlappable communication FSDP really hides: NCCL kernels take SMs, and the
# first all-gather / last reduce-scatter of a pass cannot overlap. 0.8 is a judgement, overridable, calibratable.
DEFAULT_OVERLAP = 0.8


def collective_time_s(
    collective: str, n_ranks: int, size_bytes: float, busbw_gbytes_s: float, alpha_s: float = 0.0
) -> float:
    """alpha-beta time of one collective: alpha x ring steps + S x bus factor / busbw (nccl-tests definitions)."""
    if n_ranks <= 1 or size_bytes <= 0:
        return 0.0
    if busbw_gbytes_s <= 0:
        raise InputError(f"bus bandwidth must be positive, got {busbw_gbytes_s} GB/s")
    return alpha_s * ring_steps(collective, n_ranks) + size_bytes * bus_factor(collective, n_ranks) / (
        busbw_gbytes_s * 1e9
    )


# scope: "intra" (a ring inside one node), "cross" (one ring over all ranks of several nodes), "inter" (one of the
# G concurrent one-GPU-per-node rings of HYBRID's cross-node all-reduce).
BusbwCurve = Callable[[str, str, float], float]
"""(collective, scope, message bytes) -> busbw GB/s, e.g. read from a bench-net report."""


@dataclass(frozen=True)
class Network:
    """The links a plan's collectives run on.

    Without a measurement: intra-node busbw = catalog link x efficiency; the node's inter-node bandwidth is given in
    Gbit/s (all NICs of a node together). With a bench-net report, `curve` gives measured busbw per message size.
    """

    intra_gbytes_s: float
    """Per-GPU intra-node ring busbw, GB/s (NVLink/PCIe)."""
    inter_node_gbytes_s: float | None
    """A node's aggregate inter-node busbw, GB/s (None: single node, no inter-node link known)."""
    alpha_intra_s: float = DEFAULT_ALPHA_INTRA_S
    alpha_inter_s: float = DEFAULT_ALPHA_INTER_S
    curve: BusbwCurve | None = field(default=None, compare=False)
    source: str = "catalog"

    def __post_init__(self) -> None:
        if self.intra_gbytes_s <= 0:
            raise InputError(f"intra-node bandwidth must be positive, got {self.intra_gbytes_s} GB/s")
        if self.inter_node_gbytes_s is not None and self.inter_node_gbytes_s <= 0:
            raise InputError(f"inter-node bandwidth must be positive, got {self.inter_node_gbytes_s} GB/s")

    def busbw(self, collective: str, scope: str, size_bytes: float, gpus_per_node: int) -> float:
        """busbw (GB/s) a collective of this scope reaches at this message size."""
        if self.curve is not None:
            return self.curve(collective, scope, size_bytes)
        if scope == "intra":
            return self.intra_gbytes_s
        if collective == "send_recv":
            # A point-to-point hop between nodes runs from one GPU to one GPU: that GPU's share of the node's NICs
            # (rail-optimised nodes give each GPU its own NIC), whatever the group.
            return min(self.intra_gbytes_s, self._inter() / gpus_per_node)
        if scope == "cross":
            return min(self.intra_gbytes_s, self._inter())  # the ring's slowest link
        return min(self.intra_gbytes_s, self._inter() / gpus_per_node)  # G rings share the NICs

    def _inter(self) -> float:
        if self.inter_node_gbytes_s is None:
            raise InputError(
                "the plan spans several nodes but no inter-node bandwidth is known",
                hint="pass --inter-gbps X (per node) or --net bench.json",
            )
        return self.inter_node_gbytes_s

    def alpha(self, scope: str) -> float:
        return self.alpha_intra_s if scope == "intra" else self.alpha_inter_s

    def scaled(self, factor: float) -> Network:
        """The same network with every bandwidth multiplied by `factor` (used by property tests)."""
        curve = self.curve
        scaled_curve = None if curve is None else (lambda c, s, b: factor * curve(c, s, b))
        return Network(
            self.intra_gbytes_s * factor,
            None if self.inter_node_gbytes_s is None else self.inter_node_gbytes_s * factor,
            self.alpha_intra_s,
            self.alpha_inter_s,
            scaled_curve,
            self.source,
        )


def gbps_to_gbytes_s(gbps: float) -> float:
    """Gbit/s (how NICs are sold) -> GB/s."""
    return gbps / 8


@dataclass(frozen=True)
class CommOp:
    """One kind of collective a step issues, with its total time per step."""

    name: str
    """e.g. 'all-gather (forward)'."""
    collective: str
    scope: str
    n_ranks: int
    bytes_per_call: float
    """S of one call (one decoder layer's worth)."""
    calls_per_step: int
    phase: str
    """'forward', 'backward' (hidden behind that phase of its micro-batch) or 'last_backward' (once per step,
    behind the last micro-batch's backward); 'step' (once per step between the optimizer step and the next forward:
    nothing to hide behind); 'tp' for tensor parallelism's collectives (see `tp_step_comm`)."""
    busbw_gbytes_s: float
    time_per_call_s: float

    @property
    def time_per_step_s(self) -> float:
        return self.time_per_call_s * self.calls_per_step


@dataclass(frozen=True)
class StepComm:
    """Communication of one optimizer step and how much of it the compute hides."""

    ops: list[CommOp]
    total_s: float
    exposed_s: float
    bottleneck: str
    """The op with the most time, with its link (for explanations)."""


@dataclass(frozen=True)
class CommShape:
    """What the strategy needs to know about the model and the step."""

    params: int
    num_layers: int
    param_bytes: float = 2
    """Bytes per parameter all-gathered (bf16 compute copy; under the float8 all-gather the average of the converted
    linears' 1 byte and the rest's 2, llmctl.plan.timing.float8_gather)."""
    grad_bytes: int = 4
    """Bytes per gradient element reduced (llmctl's engine: MixedPrecisionPolicy reduce_dtype=float32)."""
    tp: int = 1
    """Tensor-parallel degree: each rank holds 1/tp of the split parameters, so FSDP gathers and reduces that."""
    tp_replicated_params: int = 0
    """Parameters every rank of a tp group holds whole (norms, MoE blocks): FSDP moves them whole."""
    grad_params: float | None = None
    """Parameters whose gradients FSDP reduces (None: every one; LoRA: the adapters only, the frozen base has none)."""
    float8_amaxes: int = 0
    """Weights whose fp32 amaxes one all-reduce over the shard group gathers once a step, after the optimizer step
    (torchao precompute_float8_dynamic_scale_for_fsdp, under the float8 all-gather); 0: none."""
    expert_params: int = 0
    """Of `params`, the routed experts' (llmctl.plan.experts.routed_expert_params). Under expert parallelism
    (dims.ep > 1) FSDP gathers and reduces them apart: each rank its E/ep local experts over the efsdp group
    (`step_comm`); 0, or ep 1: with the rest."""
    moe_layers: int = 0
    """The MoE layers `expert_params` lie in (one expert all-gather and reduce-scatter each)."""

    @property
    def params_per_rank(self) -> float:
        """Parameters one rank of a tp group holds (before FSDP's sharding)."""
        return (self.params - self.tp_replicated_params) / self.tp + self.tp_replicated_params


def _exposed(comm_s: float, window_s: float, overlap: float) -> float:
    """Communication not hidden: comm - overlap x min(comm, window) (see module docstring)."""
    return comm_s - overlap * min(comm_s, window_s)


def step_comm(
    dims: ParallelDims,
    shape: CommShape,
    gpus_per_node: int,
    grad_accum: int,
    fwd_s: float,
    bwd_s: float,
    net: Network,
    overlap: float = DEFAULT_OVERLAP,
    sync_every_micro_batch: bool = True,
    pipelined: bool = False,
) -> StepComm:
    """Communication per optimizer step for the parallel degrees `dims`, ranks filled node by node.

    fwd_s / bwd_s: compute time of ONE micro-batch's forward and backward (recompute included) on one GPU.
    sync_every_micro_batch: reduce-scatter the gradients after every micro-batch (FSDP's default, and what keeps
    gradients sharded as the memory model assumes); False models no_sync accumulation (one reduce per step).
    pipelined: under pipeline parallelism (dims.pp > 1; `shape` is one pp rank's stages) FSDP gathers a stage's
    parameters once per schedule run and keeps them (no reshard after forward, nor after backward until the run's
    last) and reduce-scatters its gradients at the run's last backward (torch.distributed.pipelining.stage,
    backward_maybe_with_nosync): `grad_accum` is then the schedule runs per step, fwd_s / bwd_s one micro-batch's.
    """
    if not 0 <= overlap <= 1:
        raise InputError(f"overlap must be in [0, 1], got {overlap}")
    if grad_accum < 1:
        raise InputError(f"gradient accumulation must be >= 1, got {grad_accum}")
    if dims.pp > 1 and not pipelined:
        raise InputError("pipeline parallelism's FSDP is priced per schedule run: pass pipelined=True (pp > 1)")
    if dims.tp != shape.tp:
        raise InputError(f"the parallel degrees have tp {dims.tp} but the shape tp {shape.tp}")
    L = shape.num_layers
    layer_params = shape.params_per_rank / L
    layer_grads = layer_params if shape.grad_params is None else shape.grad_params / L
    spans_nodes = dims.world_size > gpus_per_node
    ops: list[CommOp] = []

    def op(
        name: str, collective: str, scope: str, ranks: int, size: float, calls: int, phase: str, stride: int = 1
    ) -> None:
        if ranks <= 1 or calls <= 0:
            return
        bw = net.busbw(collective, scope, size, gpus_per_node)
        if scope == "cross" and stride > 1 and net.inter_node_gbytes_s:
            # `stride` concurrent groups (one per tp rank, ...) each have ranks on every node: they share its NICs.
            bw = min(bw, net.inter_node_gbytes_s / stride)
        t = collective_time_s(collective, ranks, size, bw, net.alpha(scope))
        ops.append(CommOp(name, collective, scope, ranks, size, calls, phase, bw, t))

    # FSDP's group is dp_shard x cp (a cp group shards the states as data-parallel ranks do: torchtitan's
    # dp_shard_cp); with DDP's degrees (no_shard) and cp > 1 the engine's FSDP2 still shards over the cp group.
    S, R = dims.fsdp_shard, dims.dp_replicate
    # Under expert parallelism the routed experts leave the dense FSDP group (llmctl.plan.experts): their own
    # gathers and reductions; the replicas' all-reduce moves every gradient shard as before.
    experts = shape.expert_params / L if dims.ep > 1 and shape.moe_layers else 0
    dense_params, dense_grads = layer_params - experts, layer_grads - experts
    if experts:
        _expert_ops(op, dims, shape, gpus_per_node, grad_accum, sync_every_micro_batch, pipelined)
    if S > 1:
        if dims.zero_stage in (1, 2):
            raise InputError(
                f"no communication model for ZeRO stage {dims.zero_stage}",
                hint="the planner models FSDP: full_shard, hybrid_shard, no_shard",
            )
        scope = dims.group_scope("dp_shard", gpus_per_node)
        where = ", intra-node" if scope == "intra" and spans_nodes else ""
        rs_calls = L * (grad_accum if sync_every_micro_batch else 1)
        rs_phase = "backward" if sync_every_micro_batch else "last_backward"
        gathered = dense_params * shape.param_bytes
        k = dims.tp  # the shard groups side by side (one per tp rank: the group's stride)
        op(f"all-gather (forward{where})", "all_gather", scope, S, gathered, L * grad_accum, "forward", k)
        if not pipelined:  # a pipeline keeps the stage gathered through the run's backward
            op(f"all-gather (backward{where})", "all_gather", scope, S, gathered, L * grad_accum, "backward", k)
        name = f"reduce-scatter{' (intra-node)' if where else ''}"
        op(name, "reduce_scatter", scope, S, dense_grads * shape.grad_bytes, rs_calls, rs_phase, k)
        if shape.float8_amaxes:
            op("all-reduce (float8 weight amaxes)", "all_reduce", scope, S, 4 * shape.float8_amaxes, 1, "step", k)
    if R > 1:
        scope = dims.group_scope("dp_replicate", gpus_per_node)
        name = f"all-reduce of the {'shard' if S > 1 else 'gradients'}{' (inter-node)' if scope == 'inter' else ''}"
        k = dims.tp * S
        op(name, "all_reduce", scope, R, layer_grads * shape.grad_bytes / S, L, "last_backward", k)

    fwd = sum(o.time_per_call_s * o.calls_per_step / grad_accum for o in ops if o.phase == "forward")
    bwd = sum(o.time_per_call_s * o.calls_per_step / grad_accum for o in ops if o.phase == "backward")
    last = sum(o.time_per_step_s for o in ops if o.phase == "last_backward")
    between = sum(o.time_per_step_s for o in ops if o.phase == "step")
    # Every micro-batch hides its own forward/backward collectives; the last one also carries the once-per-step ops.
    exposed = (
        grad_accum * _exposed(fwd, fwd_s, overlap)
        + (grad_accum - 1) * _exposed(bwd, bwd_s, overlap)
        + _exposed(bwd + last, bwd_s, overlap)
        + between
    )
    total = sum(o.time_per_step_s for o in ops)
    top = max(ops, key=lambda o: o.time_per_step_s, default=None)
    bottleneck = "" if top is None else f"{top.name} at {top.busbw_gbytes_s:.3g} GB/s"
    return StepComm(ops=ops, total_s=total, exposed_s=max(0.0, exposed), bottleneck=bottleneck)


def _expert_ops(
    op: Callable[..., None],
    dims: ParallelDims,
    shape: CommShape,
    gpus_per_node: int,
    grad_accum: int,
    sync_every_micro_batch: bool,
    pipelined: bool,
) -> None:
    """FSDP's collectives of the routed experts under expert parallelism: per MoE layer, each rank's E/ep local
    experts all-gathered and their gradients reduce-scattered over the efsdp group (dp_shard x cp / ep ranks, strided
    by ep: llmctl.spec.parallel.ParallelDims.group_scope), as the dense layers are over dp_shard x cp."""
    E, M = dims.expert_shard, shape.moe_layers
    if E <= 1:
        return
    local = shape.expert_params / dims.ep / M  # one MoE layer's local experts
    scope = dims.group_scope("efsdp", gpus_per_node)
    k = dims.tp * dims.ep  # the efsdp groups side by side
    op(
        "all-gather of the local experts (forward)",
        "all_gather",
        scope,
        E,
        local * shape.param_bytes,
        M * grad_accum,
        "forward",
        k,
    )
    if not pipelined:
        op(
            "all-gather of the local experts (backward)",
            "all_gather",
            scope,
            E,
            local * shape.param_bytes,
            M * grad_accum,
            "backward",
            k,
        )
    calls = M * (grad_accum if sync_every_micro_batch else 1)
    phase = "backward" if sync_every_micro_batch else "last_backward"
    op("reduce-scatter of the local experts", "reduce_scatter", scope, E, local * shape.grad_bytes, calls, phase, k)


# --- tensor parallelism (module docstring) ----------------------------------------------------------------------
@dataclass(frozen=True)
class TpLayer:
    """One kind of decoder layer as tensor parallelism sees it: how many there are, how many are recomputed, and the
    seconds of one micro-batch's forward matmuls on one rank that each collective feeds or follows (async TP
    pipelines them; 0 where there is none)."""

    count: int
    recomputed: int = 0
    dense_mlp: bool = True
    """The MLP is split (gate/up column-wise, down row-wise); False: a MoE block replicated over the tp group."""
    norm_after_mlp: bool = False
    """A norm inside the layer reads the MLP's reduce-scatter output (Gemma): the recompute re-runs it."""
    qkv_s: float = 0.0
    o_s: float = 0.0
    gate_up_s: float = 0.0
    down_s: float = 0.0


@dataclass(frozen=True)
class TpCall:
    """One kind of TP collective per micro-batch: how many calls, and the matmul seconds it can hide behind."""

    collective: str
    phase: str
    """forward | backward | recompute."""
    calls: int
    matmul_s: float = 0.0


def tp_calls(layers: list[TpLayer], head_s: float = 0.0, embedding: bool = True, head: bool = True) -> list[TpCall]:
    """The TP collectives of one micro-batch (module docstring). Backward pairs each collective with the input-gradient
    matmul of the same projection (as long as its forward matmul). `embedding` / `head`: whether the rank holds them
    (a pipeline's first and last stages)."""
    out: list[TpCall] = []
    if embedding:
        out += [
            TpCall("all_reduce", "forward", 1),  # embedding
            TpCall("all_gather", "backward", 1),  # embedding: the first layer's cut, backward
        ]
    if head:
        out += [
            TpCall("all_gather", "forward", 1, head_s),  # LM head input
            TpCall("reduce_scatter", "backward", 1, head_s),  # LM head input's gradient
        ]
    for la in layers:
        n, r = la.count, la.recomputed
        out += [
            TpCall("all_gather", "forward", n, la.qkv_s),
            TpCall("reduce_scatter", "forward", n, la.o_s),
            TpCall("all_gather", "forward", n, la.gate_up_s if la.dense_mlp else 0.0),
            TpCall("all_gather", "backward", n, la.o_s),
            TpCall("reduce_scatter", "backward", n, la.qkv_s),
            TpCall("all_gather", "recompute", r, la.qkv_s),
            TpCall("reduce_scatter", "recompute", r, la.o_s),
            TpCall("all_gather", "recompute", r, la.gate_up_s if la.dense_mlp else 0.0),
        ]
        if la.dense_mlp:
            out += [
                TpCall("reduce_scatter", "forward", n, la.down_s),
                TpCall("all_gather", "backward", n, la.down_s),
                TpCall("reduce_scatter", "backward", n, la.gate_up_s),
            ]
        else:
            out.append(TpCall("all_gather", "backward", n))  # the gradient of the output's cut to the shard
        if la.norm_after_mlp:
            out.append(TpCall("reduce_scatter", "recompute", r, la.down_s if la.dense_mlp else 0.0))
    return [c for c in out if c.calls > 0]


def tp_step_comm(
    calls: list[TpCall],
    tp: int,
    activation_bytes: float,
    grad_accum: int,
    net: Network,
    gpus_per_node: int,
    async_tp: bool = False,
) -> StepComm:
    """TP's communication per optimizer step: every call moves the activation (b x s x h x compute bytes: the
    all-gather's output, the reduce-scatter's input, the all-reduce's buffer) over the tp ranks of one node, once per
    micro-batch; all exposed, or with async TP max(comm / tp, comm - matmul) per call paired with a matmul."""
    if tp <= 1 or not calls:
        return StepComm(ops=[], total_s=0.0, exposed_s=0.0, bottleneck="")
    if gpus_per_node % tp:
        raise InputError(f"tp {tp} does not divide the {gpus_per_node} GPUs of a node (a TP group stays in one node)")
    per_call: dict[str, float] = {}
    bw: dict[str, float] = {}
    for c in {c.collective for c in calls}:
        bw[c] = net.busbw(c, "intra", activation_bytes, gpus_per_node)
        per_call[c] = collective_time_s(c, tp, activation_bytes, bw[c], net.alpha("intra"))
    counts: dict[tuple[str, str], int] = {}
    exposed = 0.0
    for c in calls:
        counts[(c.collective, c.phase)] = counts.get((c.collective, c.phase), 0) + c.calls
        t = per_call[c.collective]
        hidden = async_tp and c.matmul_s > 0
        exposed += c.calls * (max(t / tp, t - c.matmul_s) if hidden else t)
    ops = [
        CommOp(
            f"TP {coll.replace('_', '-')} ({phase})",
            coll,
            "intra",
            tp,
            activation_bytes,
            n * grad_accum,
            "tp",
            bw[coll],
            per_call[coll],
        )
        for (coll, phase), n in counts.items()
    ]
    total = sum(o.time_per_step_s for o in ops)
    top = max(ops, key=lambda o: o.time_per_step_s)
    return StepComm(ops, total, exposed * grad_accum, f"{top.name} at {top.busbw_gbytes_s:.3g} GB/s")


def combine(a: StepComm, b: StepComm) -> StepComm:
    """Two sets of collectives of one step (data-parallel and tensor-parallel): times add, the bottleneck is the op
    with the most time."""
    if not b.ops:
        return a
    ops = a.ops + b.ops
    top = max(ops, key=lambda o: o.time_per_step_s)
    return StepComm(
        ops, a.total_s + b.total_s, a.exposed_s + b.exposed_s, f"{top.name} at {top.busbw_gbytes_s:.3g} GB/s"
    )
