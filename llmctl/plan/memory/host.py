"""Host memory per node of a training setup: what the node's RAM holds besides the GPUs (torch-free).

Per rank (a node runs one process per GPU):
- the process itself: Python, torch, transformers and llmctl imported, nothing built (PROCESS_BYTES, measured);
- on a GPU, the CUDA runtime's host side (driver, cuBLAS/cuDNN/NCCL host state) (CUDA_RUNTIME_HOST_BYTES, assumed);
- building the model: llmctl's engine reads only this rank's rows of each tensor (safetensors are memory-mapped:
  page cache, not the process's) and fills one tensor at a time; a random init draws the rank's shard of one
  tensor into an fp32 host buffer before copying it to the GPU (llmctl.engine.materialize.draw_rows). The largest
  tensor's shard in fp32 bounds both; under QLoRA each rank also reads every block linear whole in fp32 to quantize
  it (llmctl.engine.qlora.fill), so the largest block linear in fp32 does;
- checkpoint staging: torch.distributed.checkpoint's FileSystemWriter copies each tensor to the host as it writes it,
  up to `per_thread_copy_ahead` (10 MB by default) ahead (torch/distributed/checkpoint/filesystem.py,
  _OverlappingCpuLoader): the largest state tensor's shard plus 10 MB;
- the data: the micro-batch being trained on and the next one, pinned (inputs, targets, positions; int64); the
  token shards are memory-mapped (page cache: the kernel gives it back under pressure, so it is not counted).
Per node: the CPU offload states (llmctl.plan.memory.estimate's host components) for its GPUs.

Checked against the node's memory: a cluster file's node_memory_gib, else the GPU catalog's node_memory_gib_per_gpu
times the GPUs per node (llmctl.plan.memory.estimate.host_capacity_bytes); not checked where neither is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmctl.units import GIB, MIB

if TYPE_CHECKING:
    from llmctl.plan.memory.estimate import MemoryEstimate
    from llmctl.spec.models import ModelSpec
    from llmctl.spec.setup import TrainSetup

PROCESS_BYTES = 470 * MIB
"""A rank before its model: the start event's rss_before_model_bytes of examples/tiny-cpu.yaml and
examples/lora-cpu.yaml on the CI machine (455 and 469 MiB; Python 3.11, torch 2.13, transformers 5 imported)."""
CUDA_RUNTIME_HOST_BYTES = 1 * GIB
"""The CUDA runtime's host memory per process: ASSUMED, not measured here (no GPU in CI). pytorch/pytorch#12873
measured +1.1 GB of RSS at the first CUDA op; lazy module loading (CUDA_MODULE_LOADING=LAZY, torch >= 1.13) lowers
it. The GPU tier reports each run's peak_rss_bytes to replace this figure."""
COPY_AHEAD_BYTES = 10_000_000
"""torch.distributed.checkpoint FileSystemWriter's per_thread_copy_ahead default."""


@dataclass(frozen=True)
class HostMemory:
    per_rank: dict[str, int]
    """What one rank's process holds, by item."""
    ranks_per_node: int
    offload_per_node: int
    """CPU offload's parameters, gradients and optimizer states for the node's GPUs (0 without offload)."""
    capacity_bytes: int | None
    """The node's memory (None: not known)."""
    gpu: bool

    @property
    def per_node(self) -> int:
        return self.ranks_per_node * sum(self.per_rank.values()) + self.offload_per_node

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_bytes is None else self.per_node <= self.capacity_bytes

    def line(self) -> str:
        """'12.1 GiB per node (8 ranks x 1.5 GiB: process 0.46, CUDA runtime 1.0 (assumed), ...) of 2,048 GiB: fits'."""
        parts = ", ".join(
            f"{name} {b / GIB:.2f}" + (" (assumed)" if name == "CUDA runtime" else "")
            for name, b in self.per_rank.items()
        )
        off = f"; CPU offload states {self.offload_per_node / GIB:,.1f} GiB" if self.offload_per_node else ""
        rank = sum(self.per_rank.values())
        ranks = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''}"
        head = f"{self.per_node / GIB:,.1f} GiB per node ({ranks} x {rank / GIB:.2f} GiB: {parts}{off})"
        if self.capacity_bytes is None:
            return head + "; the node's memory is not known (a cluster file's node_memory_gib checks it)"
        verdict = "fits" if self.fits else "does NOT fit"
        return f"{head} of the node's {self.capacity_bytes / GIB:,.0f} GiB: {verdict}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "per_rank_bytes": dict(self.per_rank),
            "ranks_per_node": self.ranks_per_node,
            "offload_bytes_per_node": self.offload_per_node,
            "bytes_per_node": self.per_node,
            "capacity_bytes_per_node": self.capacity_bytes,
            "fits": self.fits,
            "line": self.line(),
        }


def largest_tensor_shard(spec: ModelSpec, setup: TrainSetup) -> int:
    """Values of the largest parameter tensor's shard on one rank (tp splits, then FSDP's shard group)."""
    tensors = spec.embedding_tensors() + spec.head_tensors()
    seen = set()
    for i, layer in enumerate(spec.layers):
        if layer not in seen:
            seen.add(layer)
            tensors += spec.layer_tensors(i)
    largest = max((math.prod(shape) for _, shape in tensors), default=0)
    shard = setup.dims.fsdp_shard if setup.engine == "fsdp2" else 1
    return math.ceil(setup.dims.rank_shard(setup.seq_len).params(largest) / shard)


def host_memory(
    spec: ModelSpec, setup: TrainSetup, est: MemoryEstimate, capacity_per_gpu: int | None, gpu: bool = True
) -> HostMemory:
    """The node's host memory for `setup` (module docstring); `capacity_per_gpu` from host_capacity_bytes."""
    tensor = largest_tensor_shard(spec, setup)
    per_rank = {"process": PROCESS_BYTES}
    if gpu:
        per_rank["CUDA runtime"] = CUDA_RUNTIME_HOST_BYTES
    loading = 4 * tensor
    if setup.finetune.method == "qlora":  # each rank reads every block linear whole, in fp32, to quantize it
        from llmctl.plan.memory.adapters import dequantized_linear_bytes

        loading = max(loading, 4 * dequantized_linear_bytes(spec, setup) // setup.compute_bytes)
    per_rank["model loading"] = loading
    per_rank["checkpoint staging"] = tensor * setup.precision.param_bytes + COPY_AHEAD_BYTES
    per_rank["micro-batches"] = 2 * 3 * 8 * setup.micro_batch_size * (setup.dims.rank_shard(setup.seq_len).tokens + 1)
    gpn = setup.gpus_per_node
    return HostMemory(
        per_rank=per_rank,
        ranks_per_node=gpn,
        offload_per_node=est.host_node_bytes,
        capacity_bytes=None if capacity_per_gpu is None else capacity_per_gpu * gpn,
        gpu=gpu,
    )


def host_memory_of(spec: ModelSpec, setup: TrainSetup, capacity_per_gpu: int | None, gpu: bool = True) -> HostMemory:
    """`host_memory` with the setup's own estimate (what a plan's chosen setup reports)."""
    from llmctl.plan.memory.estimate import estimate

    return host_memory(spec, setup, estimate(spec, setup), capacity_per_gpu, gpu)
