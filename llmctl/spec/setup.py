"""The training setup: one type for how a model is trained and on how many GPUs (torch-free).

The plan file reads and writes it (`Plan.setup`, `Plan.with_setup`), the memory model sizes it, the planner times it
(a candidate is a setup plus its prediction), `llmctl tune` varies it and the engine runs it. torchtitan's JobConfig
-> ParallelDims is the model: one object flows from the file to the mesh.

The data-parallel layout is given in its friendly spelling (a strategy over nodes x GPUs per node, with the tp, cp,
pp and ep degrees) and turned into degrees once, in `__post_init__` (`dims`); everything downstream reads the
degrees, never the strategy name (which stays for labels and the plan file). The precision is a `PrecisionPolicy`
(given by name or as a policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmctl.errors import InputError, UnknownNameError
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.attention import Attention, attention
from llmctl.spec.finetune import Finetune
from llmctl.spec.optimizer_states import AUTO as AUTO_STATES
from llmctl.spec.optimizer_states import canonical_states
from llmctl.spec.parallel import ParallelDims, canonical_strategy, sequence_split_problem
from llmctl.spec.precision import PrecisionPolicy, policy
from llmctl.units import GIB

if TYPE_CHECKING:
    from llmctl.spec.hardware import GPUSpec
    from llmctl.spec.models import ModelSpec

OPTIMIZERS = ("adamw", "adamw-8bit", "adafactor", "lion", "sgd", "none")
ENGINES = ("fsdp2", "zero")
"""Which model-state ledger: llmctl's engine (torch FSDP2), or DeepSpeed/Megatron's ZeRO (a persistent half copy)."""
ATTENTIONS = ("eager", "sdpa", "flash")
CP_ROTATES = ("allgather", "alltoall")
"""How context parallelism's ring moves keys and values (torch.distributed.tensor.experimental.set_rotate_method)."""
"""Attention kernels; a plan may also say `auto` (flash where it runs, else sdpa: `TrainSetup.kernel`)."""

# CUDA context + cuBLAS/cuDNN workspaces + NCCL communicator buffers, outside the caching allocator.
# PyTorch >= 1.13 with lazy module loading uses ~0.5-0.9 GiB of context (0.9 GB measured on an A100,
# docs/sources.md#tune-up-seed); NCCL adds ~0.2-0.5 GiB per communicator. 1 GiB is the stated default.
DEFAULT_CUDA_CONTEXT_BYTES = 1 * GIB
# Caching-allocator fragmentation: reserved/allocated is typically 1.05-1.15 in FSDP training.
DEFAULT_HEADROOM_FRACTION = 0.10


def canonical(value: str, allowed: tuple[str, ...], what: str, aliases: dict[str, str] | None = None) -> str:
    """The one spelling of a name among `allowed` (any case, `_` for `-`), or one line naming the choices."""
    v = value.strip().lower().replace("_", "-")
    v = (aliases or {}).get(v, v)
    if v not in allowed:
        raise UnknownNameError(f"unknown {what} {value!r}", hint="choose one of: " + ", ".join(allowed))
    return v


@dataclass(frozen=True)
class MemoryLevers:
    """What trades time or quality for memory beyond checkpointing (and the optimizer states' dtype): CPU offload now;
    the adapter (LoRA) slot next."""

    offload: bool = False
    """Sharded parameters (the fp32 masters), their gradients and so the optimizer states and step in host memory
    (FSDP2's CPUOffloadPolicy): each layer's shard is copied to the GPU before its all-gather, each reduced gradient
    shard copied back (plan file: parallel.offload)."""


@dataclass(frozen=True)
class TrainSetup:
    """How the model is trained and on how many GPUs."""

    precision: PrecisionPolicy | str = "bf16-mixed"
    """A policy, or its name (turned into the policy)."""
    optimizer: str = "adamw"
    optimizer_states: str = "auto"
    """What AdamW's two moments are stored in: auto (the precision's optimizer_state_dtype) | fp32 | bf16 | 8bit
    (llmctl.spec.optimizer_states; a memory lever used only when asked); `states_dtype` resolves auto."""
    strategy: str = "full_shard"
    """The data-parallel layout's friendly name (llmctl.spec.parallel); `dims` holds its degrees."""
    nodes: int = 1
    gpus_per_node: int = 1
    tp: int = 1
    """Tensor-parallel degree, with sequence parallelism (the norms' inputs are split by tp too): the tp ranks of one
    group are consecutive inside a node and share one micro-batch."""
    async_tp: bool = False
    """Async TP (torch's symmetric-memory micro-pipelining of TP's all-gather and reduce-scatter with the matmuls):
    CUDA only, and needs compile (torchtitan's `enable_async_tensor_parallel`)."""
    cp: int = 1
    """Context-parallel degree: the sequence split over cp ranks (ring attention: each rank keeps its queries and the
    keys/values rotate around the cp group), the cp ranks of one group share one micro-batch."""
    cp_load_balance: bool = True
    """Head-tail split of a causal sequence (rank i holds chunks i and 2cp-1-i of 2cp), so every rank does the same
    attention work; off, the last rank does cp times the first's."""
    cp_rotate: str = "allgather"
    """How keys/values go round the ring: `allgather` (one all-gather of every rank's K/V per attention, all of them
    held at once) or `alltoall` (one neighbour's K/V per step, cp-1 steps); torch's `set_rotate_method`."""
    pp: int = 1
    """Pipeline-parallel degree (1F1B: the first stage holds pp micro-batches in flight)."""
    ep: int = 1
    """Expert-parallel degree; 1 until expert parallelism lands."""
    shard_size: int | None = None
    """hybrid_shard: ranks per shard group (None: the data-parallel ranks of one node)."""
    micro_batch_size: int = 1
    """Sequences per data-parallel rank per forward/backward (a tp or cp group shares one micro-batch)."""
    grad_accum_steps: int = 1
    seq_len: int = 2048
    checkpointing: str = "none"
    """none | selective | partial:K | full (llmctl.spec.checkpointing)."""
    attention: Attention | str = Attention.SDPA
    """eager | sdpa | flash, or auto (what the engine picks on the hardware: `kernel`)."""
    compile: bool = False
    loss_chunk_tokens: int = 0
    """0: whole logits; N: the LM head and loss over chunks of N tokens (llmctl.engine.loss)."""
    engine: str = "fsdp2"
    """The model-state ledger (ENGINES): what keeps which copy of the weights."""
    levers: MemoryLevers = field(default_factory=MemoryLevers)
    finetune: Finetune = field(default_factory=Finetune)
    """Full training, or LoRA / QLoRA adapters on a frozen base (llmctl.spec.finetune)."""
    fused_optimizer: bool = True
    """Fused AdamW (the GPU default) has no step temporaries; foreach materialises some."""
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    dims: ParallelDims = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", policy(self.precision))
        object.__setattr__(
            self,
            "optimizer",
            canonical(self.optimizer, OPTIMIZERS, "optimizer", {"adam": "adamw", "adamw8bit": "adamw-8bit"}),
        )
        object.__setattr__(self, "optimizer_states", canonical_states(self.optimizer_states))
        if self.optimizer_states != AUTO_STATES and self.optimizer != "adamw":
            raise InputError(
                f"optimizer states {self.optimizer_states} apply to adamw's two moments, not {self.optimizer}",
                hint="drop the optimizer states, or use the adamw optimizer",
            )
        object.__setattr__(self, "strategy", canonical_strategy(self.strategy))
        object.__setattr__(self, "engine", canonical(self.engine, ENGINES, "engine"))
        object.__setattr__(self, "checkpointing", ckpt_modes.parse(self.checkpointing))
        object.__setattr__(self, "attention", attention(self.attention))
        for name in ("nodes", "gpus_per_node", "tp", "cp", "pp", "ep", "micro_batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {getattr(self, name)}")
        if self.seq_len < 1:
            raise InputError(f"seq len must be a positive integer, got {self.seq_len}")
        if self.ep > 1:
            raise InputError("expert parallelism is not modelled yet (ep = 1)")
        object.__setattr__(self, "cp_rotate", canonical(self.cp_rotate, CP_ROTATES, "cp rotate method"))
        if self.loss_chunk_tokens < 0:
            raise InputError(f"loss chunk must be >= 0 tokens, got {self.loss_chunk_tokens}")
        if self.tp > 1 and self.loss_chunk_tokens:
            raise InputError(
                "a chunked loss does not run with tensor parallelism (its loss is computed on vocabulary shards)",
                hint="set the loss chunk to 0 with tp > 1",
            )
        if self.async_tp and (self.tp < 2 or not self.compile):
            raise InputError("async TP needs tp > 1 and compile", hint="turn on compile, or drop async TP")
        if self.cuda_context_bytes < 0 or not 0 <= self.headroom_fraction < 1:
            raise InputError("CUDA context must be >= 0 and headroom in [0, 1)")
        if self.strategy == "hybrid_shard" and self.nodes < 2 and self.shard_size is None:
            raise InputError(
                "hybrid_shard needs at least 2 nodes (on one node it is full_shard)",
                hint="pass --nodes N --gpus-per-node G",
            )
        dims = ParallelDims.from_strategy(
            self.strategy, self.nodes, self.gpus_per_node, self.tp, self.pp, self.shard_size, self.cp, self.ep
        )
        object.__setattr__(self, "dims", dims)
        problem = sequence_split_problem(self.seq_len, self.tp, self.cp, self.cp_load_balance)
        if problem:
            raise InputError(problem, hint="choose a sequence length that is a multiple of it")
        if self.cp > 1 and self.attention in ("flash", "eager"):
            raise InputError(
                f"context parallelism runs ring attention on PyTorch SDPA, not {self.attention}",
                hint="use attention auto or sdpa with cp > 1 (SDPA's own flash kernel runs on GPUs)",
            )
        if self.engine == "fsdp2" and self.strategy == "zero1":
            raise InputError("FSDP2 has no ZeRO-1 (optimizer-only sharding)", hint="use --engine zero")
        if self.attention == "flash" and not self.precision.flash_attention:
            raise InputError("flash attention needs bf16 or fp16", hint="use --attention sdpa with fp32")
        if self.levers.offload and self.engine != "fsdp2":
            raise InputError(
                f"CPU offload is FSDP2's CPUOffloadPolicy: not run with engine {self.engine}", hint="use --engine fsdp2"
            )
        self._check_finetune()
        if self.precision.float8 and self.tp > 1:
            # torchao's float8 TP styles (Float8ColwiseParallel, ...) differ from the bf16 plan's; not wired yet
            raise InputError(
                f"precision {self.precision.name} with tensor parallelism (tp {self.tp}) is not run by llmctl's engine",
                hint="use tp 1 with float8, or bf16-mixed with tp",
            )

    def _check_finetune(self) -> None:
        """What llmctl's engine runs with adapters: FSDP2 data parallelism and cp, a half or fp32 compute dtype."""
        ft = self.finetune
        if not ft.adapters:
            return
        refusals = [
            (self.engine != "fsdp2", f"the {self.engine} engine's ledger is full training's", "drop --engine zero"),
            (self.tp > 1, f"tensor parallelism (tp {self.tp}) is not wired for adapters", "use tp 1 (FSDP, cp)"),
            (self.pp > 1, "pipeline parallelism is not run by llmctl's engine", "use pp 1"),
            (self.precision.float8, f"precision {self.precision.name} converts the frozen linears", "use bf16-mixed"),
            (self.levers.offload, "CPU offload is planned for full training only", "drop --offload"),
            (
                ft.method == "qlora" and self.precision.compute_dtype == "fp32",
                "QLoRA computes in bf16 or fp16 (its 4-bit base is dequantized to it)",
                "use precision bf16-mixed",
            ),
        ]
        for bad, why, hint in refusals:
            if bad:
                raise InputError(f"{ft.method}: {why}", hint=hint)

    # --- derived ---------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpus(self) -> int:
        return self.world_size

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def shard_degree(self) -> int:
        """Ranks one model replica's sharded states are split over (FSDP's group: dp_shard x cp)."""
        return self.dims.fsdp_shard

    @property
    def compute_bytes(self) -> int:
        return self.precision.compute_bytes

    @property
    def states_dtype(self) -> str:
        """What AdamW's moments are stored in: fp32, bf16 or 8bit (auto resolved to the precision's own)."""
        if self.optimizer_states == AUTO_STATES:
            return self.precision.optimizer_state_dtype
        return self.optimizer_states

    @property
    def training(self) -> bool:
        return self.optimizer != "none"

    @property
    def per_rank_batch(self) -> int:
        """Sequences one data-parallel rank trains on per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        return self.dims.tokens_per_step(self.micro_batch_size, self.grad_accum_steps, self.seq_len)

    @property
    def label(self) -> str:
        """'full_shard 8x1 ckpt none', '... compiled': the decisions `llmctl tune` varies."""
        return (
            f"{self.strategy} {self.micro_batch_size}x{self.grad_accum_steps} ckpt {self.checkpointing}"
            f"{' compiled' if self.compile else ''}"
        )

    def kernel(self, gpu: GPUSpec | None, spec: ModelSpec) -> str:
        """The attention kernel the engine runs for this setup's `attention`: auto is flash-attention on a GPU that
        runs it in a half precision (where flash-attn is installed), else SDPA; then what the model has
        (Gemma 2 and gpt-oss have no SDPA path)."""
        attention = self.attention
        if attention == "auto":
            # Ring attention (cp > 1) runs on SDPA, whose CUDA flash kernel is flash-attention 2's algorithm.
            flash = gpu is not None and gpu.flash_attention and self.precision.flash_attention and self.cp == 1
            attention = "flash" if flash else "sdpa"
        return spec.attention_kernel(attention)

    def decisions(self) -> dict[str, Any]:
        """The decisions a plan records for the run (the plan file's spelling)."""
        return {
            "strategy": self.strategy,
            "micro_batch": self.micro_batch_size,
            "grad_accum": self.grad_accum_steps,
            "checkpointing": self.checkpointing,
            "compile": self.compile,
            "tp": self.tp,
            "cp": self.cp,
        }
