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
  ring gets 1/G of the node's inter-node bandwidth and moves 1/G of the gradients.

Per mesh axis (llmctl.spec.parallel.ParallelDims) and per optimizer step (FSDP, one collective per decoder layer,
Zhao et al. 2023 "PyTorch FSDP", arXiv:2304.11277):
- dp_shard (S ranks): per micro-batch, all-gather the bf16 parameters in forward AND again in backward, and
  reduce-scatter the gradients (in the reduce dtype), over the S ranks of the shard group.
- dp_replicate (R groups): one all-reduce of the local gradient shard (1/S of the gradients) across the R replicas
  per optimizer step (during the last micro-batch's backward).
So FULL_SHARD (1, N) moves only the first, NO_SHARD/DDP (N, 1) only the second, HYBRID_SHARD (nodes, G) both; where
each group runs (inside a node, one rank per node, or a ring across nodes) comes from the degrees' layout.

Overlap: FSDP prefetches the next layer's all-gather during the current layer's compute and reduce-scatters during
backward. `overlap` is the fraction of the overlappable time that is really hidden (a stated parameter):
exposed = comm - overlap x min(comm, compute window). Forward-phase collectives hide behind forward compute only,
backward-phase ones behind backward compute only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmctl.errors import InputError

# The collectives, their nccl-tests bus factors and latency steps: one registry, shared with bench-net.
from llmctl.spec.collectives import COLLECTIVES as COLLECTIVES  # re-exported
from llmctl.spec.collectives import bus_factor as bus_factor  # re-exported
from llmctl.spec.collectives import ring_steps as ring_steps  # re-exported
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
        if self.inter_node_gbytes_s is None:
            raise InputError(
                "the plan spans several nodes but no inter-node bandwidth is known",
                hint="pass --inter-gbps X (per node) or --net bench.json",
            )
        if scope == "cross":
            return min(self.intra_gbytes_s, self.inter_node_gbytes_s)  # the ring's slowest link
        return min(self.intra_gbytes_s, self.inter_node_gbytes_s / gpus_per_node)  # G rings share the NICs

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
    behind the last micro-batch's backward)."""
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
    param_bytes: int = 2
    """Bytes per parameter all-gathered (bf16 compute copy)."""
    grad_bytes: int = 4
    """Bytes per gradient element reduced (llmctl's engine: MixedPrecisionPolicy reduce_dtype=float32)."""


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
) -> StepComm:
    """Communication per optimizer step for the parallel degrees `dims`, ranks filled node by node.

    fwd_s / bwd_s: compute time of ONE micro-batch's forward and backward (recompute included) on one GPU.
    sync_every_micro_batch: reduce-scatter the gradients after every micro-batch (FSDP's default, and what keeps
    gradients sharded as the memory model assumes); False models no_sync accumulation (one reduce per step).
    """
    if not 0 <= overlap <= 1:
        raise InputError(f"overlap must be in [0, 1], got {overlap}")
    if grad_accum < 1:
        raise InputError(f"gradient accumulation must be >= 1, got {grad_accum}")
    if dims.tp > 1 or dims.pp > 1:
        raise InputError("the communication model covers data parallelism only (tp = pp = 1)")
    L = shape.num_layers
    layer_params = shape.params / L
    spans_nodes = dims.world_size > gpus_per_node
    ops: list[CommOp] = []

    def op(name: str, collective: str, scope: str, ranks: int, size: float, calls: int, phase: str) -> None:
        if ranks <= 1 or calls <= 0:
            return
        bw = net.busbw(collective, scope, size, gpus_per_node)
        t = collective_time_s(collective, ranks, size, bw, net.alpha(scope))
        ops.append(CommOp(name, collective, scope, ranks, size, calls, phase, bw, t))

    S, R = dims.dp_shard, dims.dp_replicate
    if S > 1:
        if dims.zero_stage != 3:
            raise InputError(
                f"no communication model for ZeRO stage {dims.zero_stage}",
                hint="the planner models FSDP: full_shard, hybrid_shard, no_shard",
            )
        scope = dims.group_scope("dp_shard", gpus_per_node)
        where = ", intra-node" if scope == "intra" and spans_nodes else ""
        rs_calls = L * (grad_accum if sync_every_micro_batch else 1)
        rs_phase = "backward" if sync_every_micro_batch else "last_backward"
        gathered = layer_params * shape.param_bytes
        op(f"all-gather (forward{where})", "all_gather", scope, S, gathered, L * grad_accum, "forward")
        op(f"all-gather (backward{where})", "all_gather", scope, S, gathered, L * grad_accum, "backward")
        name = f"reduce-scatter{' (intra-node)' if where else ''}"
        op(name, "reduce_scatter", scope, S, layer_params * shape.grad_bytes, rs_calls, rs_phase)
    if R > 1:
        scope = dims.group_scope("dp_replicate", gpus_per_node)
        name = f"all-reduce of the {'shard' if S > 1 else 'gradients'}{' (inter-node)' if scope == 'inter' else ''}"
        op(name, "all_reduce", scope, R, layer_params * shape.grad_bytes / S, L, "last_backward")

    fwd = sum(o.time_per_call_s * o.calls_per_step / grad_accum for o in ops if o.phase == "forward")
    bwd = sum(o.time_per_call_s * o.calls_per_step / grad_accum for o in ops if o.phase == "backward")
    last = sum(o.time_per_step_s for o in ops if o.phase == "last_backward")
    # Every micro-batch hides its own forward/backward collectives; the last one also carries the once-per-step ops.
    exposed = (
        grad_accum * _exposed(fwd, fwd_s, overlap)
        + (grad_accum - 1) * _exposed(bwd, bwd_s, overlap)
        + _exposed(bwd + last, bwd_s, overlap)
    )
    total = sum(o.time_per_step_s for o in ops)
    top = max(ops, key=lambda o: o.time_per_step_s, default=None)
    bottleneck = "" if top is None else f"{top.name} at {top.busbw_gbytes_s:.3g} GB/s"
    return StepComm(ops=ops, total_s=total, exposed_s=max(0.0, exposed), bottleneck=bottleneck)
