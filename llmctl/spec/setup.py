"""The training setup: one type for how a model is trained and on how many GPUs (torch-free).

The plan file reads and writes it (`Plan.setup`, `Plan.with_setup`), the memory model sizes it, the planner times it
(a candidate is a setup plus its prediction), `llmctl tune` varies it and the engine runs it. torchtitan's JobConfig
-> ParallelDims is the model: one object flows from the file to the mesh.

Each field that is a training decision is declared here once, with `decision(...)` (llmctl.spec.decisions): its plan
file key and type, its flag and help, what the planner does when it is not pinned. The plan file's sections, the
commands' options, the planner's pins and search key are derived from these declarations; the rules between decisions
are llmctl.spec.rules, which `__post_init__` asks.

The data-parallel layout is given in its friendly spelling (a strategy over nodes x GPUs per node, with the tp, cp,
pp and ep degrees) and turned into degrees once, in `__post_init__` (`dims`); everything downstream reads the
degrees, never the strategy name (which stays for labels and the plan file). The precision is a `PrecisionPolicy`
(given by name or as a policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmctl.bounds import LIMITS
from llmctl.errors import InputError, UnknownNameError
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec import fields as ft
from llmctl.spec import pipeline, rules
from llmctl.spec.attention import Attention, attention
from llmctl.spec.decisions import decision, part
from llmctl.spec.finetune import Finetune
from llmctl.spec.optimizer_states import AUTO as AUTO_STATES
from llmctl.spec.optimizer_states import HELP as STATES_HELP
from llmctl.spec.optimizer_states import canonical_states
from llmctl.spec.parallel import ParallelDims, canonical_strategy
from llmctl.spec.pipeline import Schedule
from llmctl.spec.precision import PRECISION_HELP, PrecisionPolicy, policy
from llmctl.units import GIB

if TYPE_CHECKING:
    from llmctl.spec.hardware import GPUSpec
    from llmctl.spec.models import ModelSpec

OPTIMIZERS = ("adamw", "adamw-8bit", "adafactor", "lion", "sgd", "none")
ENGINES = ("fsdp2", "zero")
"""Which model-state ledger: llmctl's engine (torch FSDP2), or DeepSpeed/Megatron's ZeRO (a persistent half copy)."""
CP_ROTATES = ("allgather", "alltoall")
"""How context parallelism's ring moves keys and values (torch.distributed.tensor.experimental.set_rotate_method)."""

# CUDA context + cuBLAS/cuDNN workspaces + NCCL communicator buffers, outside the caching allocator.
# PyTorch >= 1.13 with lazy module loading uses ~0.5-0.9 GiB of context (0.9 GB measured on an A100,
# docs/sources.md#tune-up-seed); NCCL adds ~0.2-0.5 GiB per communicator. 1 GiB is the stated default.
DEFAULT_CUDA_CONTEXT_BYTES = 1 * GIB
# Caching-allocator fragmentation: reserved/allocated is typically 1.05-1.15 in FSDP training.
DEFAULT_HEADROOM_FRACTION = 0.10


def fsdp_wraps(dp_ranks: int, mixed: bool, offload: bool, adapters: bool) -> bool:
    """Whether llmctl's engine wraps the model in FSDP2. Over 2+ data-parallel ranks, always. A world of one has
    nothing to shard or reduce, so FSDP2 would only add its all-gather/reduce-scatter buffer copies (measured +10% step
    time for llama-tiny on a CPU); it stays on where its mixed-precision policy is how the plan's precision is applied
    (full training: fp32 masters cast to the compute dtype one unit at a time, cheaper than autocast's cache of every
    weight) or its CPU offload is how the states leave the GPU. With LoRA/QLoRA the frozen base is stored in the
    compute dtype already and the adapters are small: one rank runs under torch.autocast without FSDP2's copies of the
    base (the root and two layers: 2.8 GiB for Llama-3.1-8B) and their copy time (issue 47)."""
    return dp_ranks > 1 or offload or (mixed and not adapters)


def canonical(value: str, allowed: tuple[str, ...], what: str, aliases: dict[str, str] | None = None) -> str:
    """The one spelling of a name among `allowed` (any case, `_` for `-`), or one line naming the choices."""
    v = value.strip().lower().replace("_", "-")
    v = (aliases or {}).get(v, v)
    if v not in allowed:
        raise UnknownNameError(f"unknown {what} {value!r}", hint="choose one of: " + ", ".join(allowed))
    return v


@dataclass(frozen=True)
class MemoryLevers:
    """What trades time or quality for memory beyond checkpointing (and the optimizer states' dtype)."""

    offload: bool = decision(
        False,
        json="offload",
        key="parallel.offload",
        file_type=bool,
        write_default=False,
        flag="--offload",
        help="CPU offload (FSDP2's CPUOffloadPolicy): parameters, gradients and optimizer states in host memory, "
        "checked against the node's memory where the GPU catalog knows it.",
        pin_help="Pin CPU offload on or off (FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer states in "
        "host memory). Default: off, tried only when no setup fits the GPUs without it.",
        search="run",
    )
    """Sharded parameters (the fp32 masters), their gradients and so the optimizer states and step in host memory
    (FSDP2's CPUOffloadPolicy): each layer's shard is copied to the GPU before its all-gather, each reduced gradient
    shard copied back."""


@dataclass(frozen=True)
class TrainSetup:
    """How the model is trained and on how many GPUs."""

    # --- hardware: the cluster shape (the commands' --gpus/--nodes/--gpus-per-node or a cluster file give it) ------
    nodes: int = decision(
        1,
        key="hardware.nodes",
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--nodes"]},
        json="nodes",
        help="Number of nodes.",
    )
    gpus_per_node: int = decision(
        1,
        key="hardware.nproc_per_node",
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--nproc-per-node"]},
        help="Processes (GPUs) per node.",
    )

    # --- parallel ----------------------------------------------------------------------------------------------
    strategy: str = decision(
        "full_shard",
        json="strategy",
        key="parallel.sharding",
        file_type=ft.Sharding,
        flag="--strategy",
        help="no_shard (DDP) | zero1 | shard_grad_op (ZeRO-2) | full_shard (ZeRO-3) | hybrid_shard.",
        pin_help="Pin: full_shard | hybrid_shard | no_shard.",
        cli_type=str,
        search="key",
    )
    """The data-parallel layout's friendly name (llmctl.spec.parallel); `dims` holds its degrees. In a plan file:
    full_shard, FSDP2 over all ranks, dims (1, world); hybrid_shard, shard inside a node and replicate across nodes
    (2-D mesh); no_shard, replicate everywhere (DDP-like), (world, 1)."""
    shard_size: int | None = decision(
        None,
        key="parallel.shard_size",
        file_type=ft.Int | None,
        bounds={"ge": 1, "le": LIMITS["--gpus"]},
        help="hybrid_shard: data-parallel ranks per shard group (default: those of one node, nproc_per_node / tp). "
        "Replicate size = world / (tp x shard_size).",
    )
    tp: int = decision(
        1,
        json="tp",
        key="parallel.tp",
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--tp"]},
        flag="--tp",
        commands=("estimate", "plan", "dry-start"),
        metavar="N",
        help="Tensor-parallel degree, with sequence parallelism: tp consecutive ranks of a node split each layer's "
        "matmuls and share one micro-batch (the micro-batch is per data-parallel rank, as in torchtitan).",
        pin_help="Pin the tensor-parallel degree (sequence parallel, inside a node; 1: off). Default: try 1, 2, 4, 8 "
        "where they divide the GPUs per node and the model's heads, kv heads and MLP width.",
        search="key",
    )
    async_tp: bool = decision(
        False,
        json="async_tp",
        key="parallel.async_tp",
        file_type=bool,
        help="Async TP (CUDA only, with training.compile): TP's all-gather and reduce-scatter micro-pipelined with "
        "its matmuls (torch's symmetric memory; torchtitan's enable_async_tensor_parallel).",
    )
    cp: int = decision(
        1,
        json="cp",
        key="parallel.cp",
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--cp"]},
        flag="--cp",
        commands=("estimate", "plan", "dry-start"),
        metavar="N",
        help="Context-parallel degree: each sequence split over N GPUs (ring attention on SDPA, head-tail load "
        "balance); a cp group shares one micro-batch and states shard over data-parallel x cp ranks.",
        pin_help="Pin the context-parallel degree (ring attention: each sequence split over N GPUs; 1: off). Default: "
        "try 1, 2, 4, 8, ... where they split the GPUs and the sequence and the model's attention allows.",
        search="key",
    )
    cp_load_balance: bool = decision(
        True,
        json="cp_load_balance",
        key="parallel.cp_load_balance",
        file_type=bool,
        help="Head-tail split of causal sequences (rank i holds chunks i and 2cp-1-i of 2cp), so every rank does "
        "equal attention work; off, the last rank does cp times the first's.",
    )
    cp_rotate: str = decision(
        "allgather",
        json="cp_rotate",
        key="parallel.cp_rotate",
        file_type=ft.Literal["allgather", "alltoall"],
        help="How keys/values go round the ring: one all-gather per attention (all held at once), or cp-1 neighbour "
        "exchanges (torch's set_rotate_method).",
        search="best",
    )
    pp: int = decision(
        1,
        json="pp",
        key="parallel.pp",
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--pp"]},
        write_default=False,
        flag="--pp",
        commands=("estimate", "plan", "dry-start"),
        metavar="N",
        help="Pipeline-parallel degree: the layers split into pp stages (torchtitan's split: the embedding and the "
        "head count as one layer each), micro-batches sent stage to stage (torch.distributed.pipelining).",
        pin_help="Pin the pipeline-parallel degree (1: off). Default: try 1, 2, 4, ... while the layers split and "
        "the degree divides the GPUs.",
        plan_default=None,
        search="key",
    )
    pp_schedule: Schedule | str = decision(
        Schedule.ONE_F_ONE_B,
        json="pp_schedule",
        key="parallel.pp_schedule",
        file_type=ft.PipelineSchedule,
        write_default=False,
        flag="--pp-schedule",
        commands=("estimate", "plan", "dry-start"),
        cli_type=str,
        metavar="NAME",
        to_file=lambda v: str(v),
        plan_default=None,
        search="key",
        pin_help="Pin the pipeline schedule (1f1b | interleaved-1f1b | zbv | gpipe). Default: try 1f1b, "
        "interleaved-1f1b (2, 4, ... stages per rank) and zbv; gpipe only when pinned (it holds every micro-batch "
        "for 1f1b's bubble).",
        help="Pipeline schedule: 1f1b | interleaved-1f1b (v stages per rank, bubble / v) | zbv (zero bubble, V "
        "placement) | gpipe (all micro-batches held); torch's names (Interleaved1F1B, ZBVZeroBubble) accepted.",
    )
    pp_microbatches: int | None = decision(
        None,
        json="pp_microbatches",
        key="parallel.pp_microbatches",
        file_type=ft.Int | None,
        bounds={"ge": 1, "le": LIMITS["--global-batch"]},
        write_default=False,
        flag="--pp-microbatches",
        commands=("estimate", "plan", "dry-start"),
        metavar="N",
        search="best",
        help="Micro-batches per pipeline schedule run (divides grad accumulation; default: all of a step's, one "
        "run per step). More micro-batches, smaller bubble.",
    )
    pp_virtual_stages: int | None = decision(
        None,
        json="pp_virtual_stages",
        key="parallel.pp_virtual_stages",
        file_type=ft.Int | None,
        bounds={"ge": 1, "le": LIMITS["--pp"]},
        write_default=False,
        search="key",
        help="Pipeline stages per rank for the looped schedules (interleaved-1f1b: 2 or more, default 2; zbv: 2; "
        "1f1b and gpipe: 1).",
    )
    ep: int = decision(
        1,
        json="ep",
        key="parallel.ep",
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--ep"]},
        write_default=False,
        flag="--ep",
        commands=("estimate", "plan", "dry-start"),
        metavar="N",
        help="Expert-parallel degree (MoE models): each MoE layer's routed experts split over N ranks borrowed from "
        "the data-parallel x cp ranks (torchtitan's layout), tokens sent to their experts with all-to-all; the "
        "experts are FSDP-sharded over the remaining ranks.",
        pin_help="Pin the expert-parallel degree (1: off). Default: try 1, 2, 4, ... where it divides the routed "
        "experts and the data-parallel x cp ranks.",
        search="key",
    )

    # --- training ----------------------------------------------------------------------------------------------
    precision: PrecisionPolicy | str = decision(
        "bf16-mixed",
        key="training.precision",
        file_type=ft.Precision,
        flag="--precision",
        cli_type=str,
        cli_default="auto",
        to_file=lambda p: p.name,
        help=PRECISION_HELP + ". Default auto: bf16-mixed, fp16 where a GPU lacks bf16.",
    )
    """A policy, or its name (turned into the policy)."""
    micro_batch_size: int = decision(
        1,
        json="micro_batch",
        key="training.micro_batch_size",
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--micro-batch"]},
        flag="--micro-batch",
        help="Micro-batch size (sequences per data-parallel rank: per GPU at tp 1).",
        pin_help="Pin the micro-batch (per data-parallel rank: a TP group shares one).",
        search="best",
    )
    grad_accum_steps: int = decision(
        1,
        json="grad_accum",
        key="training.grad_accum_steps",
        # At most the largest global batch (in sequences): each accumulation step adds at least one sequence.
        file_type=ft.Int,
        bounds={"ge": 1, "le": LIMITS["--global-batch"]},
        flag="--grad-accum",
        commands=("estimate",),
        help="Micro-batches per optimizer step (with 1, the engine holds no gradients in the forward: it frees them "
        "after each step).",
    )
    seq_len: int = decision(
        2048,
        key="training.seq_len",
        file_type=ft.Int,
        bounds={"ge": 8, "le": LIMITS["--seq-len"]},
        file_default=1024,
        flag="--seq-len",
        metavar="LEN",
        help="Sequence length in tokens (4096, 4k, 128k).",
        plan_default=None,
        pin_help="Sequence length in tokens (4096, 4k, 128k); default 2048, or a GPT-2's 1024 learned positions.",
    )
    checkpointing: str = decision(
        "none",
        json="checkpointing",
        key="training.activation_checkpointing",
        file_type=ft.Checkpointing,
        flag="--checkpointing",
        help="Activation checkpointing: none | selective (attention output and every other matmul kept, the rest "
        "recomputed) | partial:K (every K-th block recomputed whole) | full (block inputs kept).",
        pin_help="Pin: none | selective | partial:K | full.",
        search="key",
    )
    """none | selective | partial:K | full (llmctl.spec.checkpointing)."""
    loss_chunk_tokens: int = decision(
        0,
        json="loss_chunk_tokens",
        key="training.loss_chunk_tokens",
        file_type=ft.Int,
        bounds={"ge": 0, "le": LIMITS["--loss-chunk"]},
        flag="--loss-chunk",
        metavar="LEN",
        help="LM head + loss over chunks of N tokens (4k = 4,096; only one chunk's b*s*V logits exist, each "
        "recomputed in backward); 0: whole logits.",
        pin_help="Pin the loss chunk in tokens (0: whole logits; default: try both).",
        search="key",
    )
    attention: Attention | str = decision(
        Attention.SDPA,
        json="attention",
        key="training.attention",
        file_type=ft.AttentionName,
        file_default="auto",
        flag="--attention",
        cli_type=str,
        help="eager (keeps the s^2 scores) | sdpa | flash (no s^2 term); a plan may say auto (flash where it runs, "
        "else sdpa).",
        pin_help="Pin: eager | sdpa | flash.",
        search="key",
    )
    """eager | sdpa | flash, or auto (what the engine picks on the hardware: `kernel`)."""
    moe_aux_loss: bool = decision(
        False,
        key="training.moe_aux_loss",
        file_type=bool,
        write_default=False,
        help="MoE models: add the family's auxiliary load-balancing loss (transformers' load_balancing_loss_func "
        "over every MoE layer's router logits, times the config's router_aux_loss_coef), as transformers trains "
        "with output_router_logits; without it a router can collapse onto a few experts.",
    )
    compile: bool = decision(
        False,
        json="compile",
        key="training.compile",
        file_type=bool,
        flag="--compile",
        commands=("plan",),
        help="torch.compile each decoder layer.",
        pin_help="Pin torch.compile on or off (default: try both).",
        search="key",
    )

    # --- optimizer ---------------------------------------------------------------------------------------------
    optimizer: str = decision(
        "adamw",
        key="optimizer.name",
        file_type=ft.Literal["adamw"],
        flag="--optimizer",
        commands=("estimate",),
        help="adamw | adamw-8bit | adafactor | lion | sgd | none (inference: weights only).",
    )
    optimizer_states: str = decision(
        "auto",
        key="optimizer.states",
        file_type=ft.States,
        write_default=False,
        flag="--optimizer-states",
        help="What AdamW's two moments are kept in: " + STATES_HELP + ". bf16 and 8bit save memory; the caveat on "
        "convergence is printed. Never picked unless asked.",
    )
    """What AdamW's two moments are stored in: auto (the precision's optimizer_state_dtype) | fp32 | bf16 | 8bit
    (llmctl.spec.optimizer_states; a memory lever used only when asked); `states_dtype` resolves auto."""

    # --- what-ifs of estimate-memory and parts ---------------------------------------------------------------------
    engine: str = decision(
        "fsdp2",
        key="",
        flag="--engine",
        commands=("estimate",),
        help="fsdp2 (llmctl's engine: no persistent half copy) | zero (DeepSpeed-style 18-byte ledger).",
    )
    """The model-state ledger (ENGINES): what keeps which copy of the weights."""
    levers: MemoryLevers = part(MemoryLevers)
    finetune: Finetune = part(Finetune)
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
        object.__setattr__(self, "strategy", canonical_strategy(self.strategy))
        object.__setattr__(self, "engine", canonical(self.engine, ENGINES, "engine"))
        object.__setattr__(self, "checkpointing", ckpt_modes.parse(self.checkpointing))
        object.__setattr__(self, "attention", attention(self.attention))
        for name in ("nodes", "gpus_per_node", "tp", "cp", "pp", "ep", "micro_batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {getattr(self, name)}")
        if self.seq_len < 1:
            raise InputError(f"seq len must be a positive integer, got {self.seq_len}")
        for name in ("pp_microbatches", "pp_virtual_stages"):  # None: the default; 0 is not "the default"
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', ' ')} must be a positive integer, got {getattr(self, name)}")
        object.__setattr__(self, "cp_rotate", canonical(self.cp_rotate, CP_ROTATES, "cp rotate method"))
        object.__setattr__(self, "pp_schedule", pipeline.schedule(self.pp_schedule))
        if self.loss_chunk_tokens < 0:
            raise InputError(f"loss chunk must be >= 0 tokens, got {self.loss_chunk_tokens}")
        if self.cuda_context_bytes < 0 or not 0 <= self.headroom_fraction < 1:
            raise InputError("CUDA context must be >= 0 and headroom in [0, 1)")
        rules.check(self, rules.BEFORE_LAYOUT)
        dims = ParallelDims.from_strategy(
            self.strategy, self.nodes, self.gpus_per_node, self.tp, self.pp, self.shard_size, self.cp, self.ep
        )
        object.__setattr__(self, "dims", dims)
        rules.check(self, rules.AFTER_LAYOUT)

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
    def fsdp_wraps(self) -> bool:
        """Whether llmctl's engine applies FSDP2 (`fsdp_wraps`, the one rule the engine and the memory model ask)."""
        return fsdp_wraps(
            self.dims.fsdp_shard * self.dims.dp_replicate,
            self.precision.mixed,
            self.levers.offload,
            self.finetune.adapters,
        )

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
    def pipeline_microbatches(self) -> int:
        """Micro-batches per pipeline schedule run (`pp_microbatches`, else all of a step's)."""
        return self.pp_microbatches or self.grad_accum_steps

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per pp rank (`pp_virtual_stages`, else the schedule's default)."""
        return self.pp_virtual_stages or self.pp_schedule.default_virtual_stages()

    @property
    def pipeline_stages(self) -> int:
        """Stages the model splits into: pp x stages per rank."""
        return self.pp * self.virtual_stages

    @property
    def per_rank_batch(self) -> int:
        """Sequences one data-parallel rank trains on per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def tokens_per_step(self) -> int:
        return self.dims.tokens_per_step(self.micro_batch_size, self.grad_accum_steps, self.seq_len)

    @property
    def label(self) -> str:
        """'full_shard 8x1 ckpt none', '... compiled', 'full_shard pp4 zbv 1x16 ...': the decisions `llmctl tune`
        varies."""
        pipe = ""
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.pp_schedule is Schedule.INTERLEAVED_1F1B else ""
            pipe = f" pp{self.pp} {self.pp_schedule}{v}"
        return (
            f"{self.strategy}{pipe} {self.micro_batch_size}x{self.grad_accum_steps} ckpt {self.checkpointing}"
            f"{' compiled' if self.compile else ''}"
        )

    def kernel(self, gpu: GPUSpec | None, spec: ModelSpec) -> Attention:
        """The attention kernel the engine runs for this setup's `attention`: auto is flash-attention on a GPU that
        runs it in a half precision (where flash-attn is installed), else SDPA; then what the model has
        (Gemma 2 and gpt-oss have no SDPA path)."""
        kernel = self.attention
        if not kernel.fixed:
            # Ring attention (cp > 1) runs on SDPA, whose CUDA flash kernel is flash-attention 2's algorithm.
            flash = gpu is not None and gpu.flash_attention and self.precision.flash_attention
            kernel = Attention.FLASH if flash and not self.dims.cp_enabled else Attention.SDPA
        return spec.attention_kernel(kernel)
