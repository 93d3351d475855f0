"""Memory model: bytes per GPU for training a ModelSpec under a sharding strategy (torch-free, pure functions).

What it predicts: the peak of PyTorch's *allocated* bytes (torch.cuda.max_memory_allocated) per GPU, as the
largest of three phases (end of forward, backward, optimizer step), not a blind sum of components. On top of it,
the caching allocator's fragmentation headroom gives *reserved* bytes, and the CUDA context (+ NCCL buffers),
which lives outside the allocator, gives what nvidia-smi shows. A setup fits when that last figure is within the
device's memory.

Model states: a ledger of bytes per parameter for precision x optimizer (the classic mixed-precision AdamW budget
is 4 fp32 master + 2 half weights + 4 fp32 grads + 8 Adam = 18), each line sharded from the ZeRO stage that
shards it (Rajbhandari et al. 2020): optimizer states from stage 1, gradients from stage 2, parameters from
stage 3. Two engines keep different things:
- "fsdp2" (llmctl's engine, torch FSDP2): the sharded fp32 parameters ARE the master weights; no persistent half
  copy exists (bf16 copies exist only for the layers unsharded at the moment: the "unsharded layers" line).
  Persistent: 4 + 4 + 8 = 16 bytes/param for mixed AdamW, all sharded under FULL/HYBRID/SHARD_GRAD_OP.
- "zero" (DeepSpeed/Megatron style): a persistent half copy (sharded only at stage 3) next to the fp32 master.

Activations are derived tensor by tensor from what Hugging Face's Llama and GPT-2 blocks save for backward
(measured with torch.autograd.graph.saved_tensors_hooks; tests/plan/test_memory_measured.py re-measures them).

The package: `ledger` (model states), `activations` (what blocks, head and loss keep), `ring` (context parallelism's
ring attention buffers), `estimate` (phases, fit, largest micro-batch, fewest GPUs; CPU offload's host lines), `report`
(estimate-memory's answer), `adapters` (LoRA / QLoRA: the frozen base, the adapters' states, what they change in the
activations), `states` (which ledger a setup keeps), `pipeline` (pipeline parallelism: each pp rank's stages,
parameters and micro-batches in flight; the estimate is the heaviest rank's). Callers use the names below.
"""

from llmctl.plan.memory.activations import (
    block_activation_terms,
    head_activation_bytes,
    layer_activation_bytes,
    layer_activation_terms,
    layer_saved_bytes,
    loss_chunk_backward_bytes,
    loss_chunk_forward_bytes,
    measured_saved_bytes,
    recompute_buffer_bytes,
    selective_layer_terms,
    shared_activation_bytes,
    stage_activation_bytes,
)
from llmctl.plan.memory.estimate import (
    OFFLOAD_COPY_IN,
    OFFLOAD_GRAD_OUT,
    Component,
    MemoryEstimate,
    MinGpus,
    StageMemory,
    estimate,
    fits,
    host_capacity_bytes,
    max_micro_batch,
    memory_key,
    min_gpus,
    pipeline_rank_estimates,
    ring_components,
    state_shard_degree,
)
from llmctl.plan.memory.host import HostMemory, host_memory, host_memory_of
from llmctl.plan.memory.ledger import StateLine, optimizer_bytes_per_param, stage_params
from llmctl.plan.memory.report import fit_report, offload_report
from llmctl.plan.memory.ring import RingBuffers, ring_buffers
from llmctl.plan.memory.states import classic_bytes_per_param, state_ledger

__all__ = [
    "HostMemory",
    "host_memory",
    "host_memory_of",
    "OFFLOAD_COPY_IN",
    "OFFLOAD_GRAD_OUT",
    "Component",
    "MemoryEstimate",
    "MinGpus",
    "RingBuffers",
    "StageMemory",
    "StateLine",
    "block_activation_terms",
    "classic_bytes_per_param",
    "estimate",
    "fit_report",
    "fits",
    "head_activation_bytes",
    "host_capacity_bytes",
    "layer_activation_bytes",
    "layer_activation_terms",
    "layer_saved_bytes",
    "loss_chunk_backward_bytes",
    "loss_chunk_forward_bytes",
    "max_micro_batch",
    "memory_key",
    "measured_saved_bytes",
    "min_gpus",
    "offload_report",
    "pipeline_rank_estimates",
    "optimizer_bytes_per_param",
    "recompute_buffer_bytes",
    "ring_buffers",
    "ring_components",
    "selective_layer_terms",
    "shared_activation_bytes",
    "stage_activation_bytes",
    "stage_params",
    "state_ledger",
    "state_shard_degree",
]
