"""CPU offload's time (FSDP2's CPUOffloadPolicy; its memory is llmctl.plan.memory.estimate's): the copies between the
host and the GPU over the GPU's host link, and the host's gradient additions and optimizer step over its share of the
node's memory bandwidth (torch-free).

What FSDP2 moves per micro-batch and rank (torch/distributed/fsdp/_fully_shard/_fsdp_param.py `all_gather_inputs`,
_fsdp_collectives.py `foreach_reduce`):
- host -> device: each layer's shard in the parameters' dtype (the fp32 masters) before its all-gather, in forward
  and again in backward (a layer resharded after forward is gathered again): 2 x the rank's shard x param bytes. The
  final norm + LM head (the root with tied embeddings) and the last layer, which stay gathered from forward to
  backward, are copied once: the count is over by their share (1-3% of a dense model's parameters).
- device -> host: each reduced gradient shard after its reduce-scatter, in the reduce dtype. The first micro-batch's
  copy is asynchronous (into pinned memory; the optimizer waits on its event); every later micro-batch's is
  synchronous, because FSDP2 adds it to the gradient already on the host right after the copy, on the CPU thread that
  launches the GPU's work: the GPU runs out of queued work while that thread waits.

Overlap (stated): the host-to-device copy runs on the all-gather's copy-in stream just before the all-gather (one
chain: copy, cast, gather); the asynchronous device-to-host copy on the reduce-scatter's stream just after it. PCIe is
full duplex and apart from NVLink, so in each phase of a micro-batch the critical chain is the longest of: FSDP's
collectives (on one NVLink), the copy-in then the all-gather, the reduce-scatter then the copy-out. It hides behind
the phase's compute as the collectives do (llmctl.plan.comm: exposed = chain - overlap x min(chain, compute)), and
offload adds what it lengthens the collectives' exposure by. Not hidden: the later micro-batches' synchronous copies
and the host's additions (nothing queued on the GPU meanwhile), and the optimizer step (between steps).

The host's work is memory-bound fp32 streaming: per later micro-batch grad += new (read two, write one: 3 x grad
bytes a parameter of the shard); per step the engine's gradient norm and clip (llmctl.engine.scaler.GradStep, clip
1.0 by default: read the gradients, then scale them in place: 3 x grad bytes) and AdamW (torch's fused CPU kernel,
torch >= 2.4: reads parameter, gradient and both moments, writes parameter and moments: 2 x param + grad + 2 x state
bytes, 28 with fp32 states). Every rank of a node does it at once, each at its GPU's share of the node's DRAM
bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.plan import comm as cm
from llmctl.plan import memory as mem
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import MemoryLevers, TrainSetup

ON = MemoryLevers(offload=True)

HOST_LINK_EFFICIENCY = 0.8
"""Fraction of the catalog's host-link rate a pinned-memory copy reaches. The x16 rates are after 128b/130b encoding;
TLP headers at a 256-byte maximum payload take ~10% more and DMA setup some: CUDA's bandwidthTest is commonly
reported at ~25 GB/s host-to-device on PCIe 4.0 x16 (A100) and ~50 GB/s on 5.0 (H100), 0.8 of 32 and 64."""
DEFAULT_HOST_LINK_GBYTES_S = 32.0
"""A GPU kind whose catalog entry does not state its host link: PCIe 4.0 x16 (31.5 GB/s per direction)."""
HOST_MEMORY_EFFICIENCY = 0.7
"""Fraction of the node's peak DRAM bandwidth the host's streaming kernels reach, all ranks at once: STREAM triad on
dual-socket servers reaches ~0.7-0.8 of peak (McCalpin's STREAM results, www.cs.virginia.edu/stream); 0.7, as the
GPU's HBM_EFFICIENCY (llmctl.plan.request), is the stated assumption (NUMA placement of each rank's pinned memory is
not modelled)."""
DEFAULT_NODE_MEMORY_GBYTES_S_PER_GPU = 51.2
"""A GPU kind whose catalog entry does not state its node's memory bandwidth: a dual-socket node of 8-channel
DDR4-3200 CPUs (AMD EPYC 7002/7003, as in DGX A100, AWS p5, GCP a2-ultragpu): 2 x 8 x 3200 MT/s x 8 bytes =
409.6 GB/s for 8 GPUs (AMD EPYC 7003 series datasheet: 8 channels, DDR4-3200)."""


@dataclass(frozen=True)
class OffloadTime:
    """What CPU offload adds to one optimizer step of one rank."""

    host_to_device_s: float
    """Per micro-batch: every layer's shard copied in, forward and backward."""
    device_to_host_s: float
    """Per micro-batch: the reduced gradient shards copied out."""
    accumulate_s: float
    """Per micro-batch after the first: the host adds the copied gradients to its own."""
    optimizer_s: float
    """Per step: the gradient norm, the clip and AdamW over the rank's shard on the host."""
    copies_exposed_s: float
    """Per step: what the copies add to the exposed communication (module docstring)."""
    host_link_gbytes_s: float
    """The copies' rate (the catalog's host link x HOST_LINK_EFFICIENCY)."""
    host_memory_gbytes_s: float
    """This rank's share of the node's DRAM bandwidth (x HOST_MEMORY_EFFICIENCY)."""
    later_micro_batches: int = 0
    """Micro-batches of a step after the first (grad_accum - 1 when training): those whose gradients the host adds."""

    @property
    def host_s(self) -> float:
        """Per step: the host's work on the critical path (every later micro-batch's addition, the step)."""
        return self.optimizer_s + self.later_micro_batches * self.accumulate_s

    @property
    def exposed_s(self) -> float:
        """Per step: all that CPU offload adds to the step time."""
        return self.copies_exposed_s + self.host_s


def link_rates(gpu: GPUSpec) -> tuple[float, float]:
    """(host link GB/s per direction, host DRAM GB/s per GPU) as reached: the catalog's figures (or the defaults above)
    x their efficiencies."""
    link = gpu.host_link_gbytes_s or DEFAULT_HOST_LINK_GBYTES_S
    dram = gpu.node_memory_gbytes_s_per_gpu or DEFAULT_NODE_MEMORY_GBYTES_S_PER_GPU
    return link * HOST_LINK_EFFICIENCY, dram * HOST_MEMORY_EFFICIENCY


def host_step_bytes_per_param(spec: ModelSpec, setup: TrainSetup) -> tuple[float, float]:
    """(bytes the host streams per parameter of the shard for one step's norm, clip and optimizer step, for one later
    micro-batch's gradient addition): module docstring."""
    p = setup.precision
    grad = p.reduce_bytes
    if not setup.training:
        return 0.0, 0.0
    states = next(
        (line.bytes_per_param for line in mem.state_ledger(spec, setup) if line.name.startswith("optimizer")), 0.0
    )
    return 2 * p.param_bytes + grad + 2 * states + 3 * grad, 3 * grad


def _exposed(chain_s: float, window_s: float, overlap: float) -> float:
    """llmctl.plan.comm's rule: what of a chain of transfers the phase's compute does not hide."""
    return chain_s - overlap * min(chain_s, window_s)


def offload_time(
    gpu: GPUSpec,
    spec: ModelSpec,
    setup: TrainSetup,
    fwd_s: float,
    bwd_s: float,
    dp_ops: list[cm.CommOp],
    overlap: float,
) -> OffloadTime:
    """What CPU offload adds to one step (module docstring): `fwd_s`, `bwd_s` are one micro-batch's compute on one
    GPU, `dp_ops` FSDP's collectives of the step (llmctl.plan.comm.step_comm), `overlap` the hidden fraction."""
    accum = setup.grad_accum_steps
    link, dram = link_rates(gpu)
    shard = mem.stage_params(spec, setup)[0] / setup.dims.fsdp_shard
    p = setup.precision
    passes = 2 if setup.training else 1  # forward, and again in backward
    h2d_pass = shard * p.param_bytes / (link * 1e9)
    d2h = shard * p.reduce_bytes / (link * 1e9) if setup.training else 0.0
    step_bytes, add_bytes = host_step_bytes_per_param(spec, setup)

    def per_mb(phase: str, collective: str | None = None) -> float:
        return sum(
            o.time_per_step_s / accum
            for o in dp_ops
            if o.phase == phase and (collective is None or o.collective == collective)
        )

    fwd, bwd = per_mb("forward"), per_mb("backward")
    ag_f, ag_b, rs = (
        per_mb("forward", "all_gather"),
        per_mb("backward", "all_gather"),
        per_mb("backward", "reduce_scatter"),
    )
    fwd_extra = _exposed(max(fwd, h2d_pass + ag_f), fwd_s, overlap) - _exposed(fwd, fwd_s, overlap)
    copies = accum * fwd_extra
    if setup.training:
        base = _exposed(bwd, bwd_s, overlap)
        gather = h2d_pass + ag_b
        first = _exposed(max(bwd, gather, rs + d2h), bwd_s, overlap) - base
        later = _exposed(max(bwd, gather), bwd_s, overlap) - base + d2h
        copies += first + (accum - 1) * later
    return OffloadTime(
        host_to_device_s=passes * h2d_pass,
        device_to_host_s=d2h,
        accumulate_s=shard * add_bytes / (dram * 1e9),
        optimizer_s=shard * step_bytes / (dram * 1e9),
        copies_exposed_s=copies,
        host_link_gbytes_s=link,
        host_memory_gbytes_s=dram,
        later_micro_batches=accum - 1 if setup.training else 0,
    )
