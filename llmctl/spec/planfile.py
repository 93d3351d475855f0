"""The plan file: the one schema shared by `llmctl plan` (writes it), `llmctl launch` (submits it) and the engine
(runs it). YAML on disk, validated here and nowhere else. Torch-free.

Unknown keys are rejected (extra="forbid"), and impossible combinations are rejected naming the key. Every number
is finite and within a documented cap (the command line's caps, `llmctl.bounds`, where the same quantity has
one): a plan the engine would choke on hours later, or after torch has started, fails here in one line instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from llmctl.bounds import GENERIC_FLOAT_LIMIT, GENERIC_INT_LIMIT, LIMITS, check
from llmctl.errors import LlmctlError, SpecError, one_line
from llmctl.fileio import load_yaml, write_atomic
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.finetune import MAX_RANK, Finetune, check_target_list, plan_fields
from llmctl.spec.models import MAX_PARAMS, MAX_TOKENS
from llmctl.spec.optimizer_states import AUTO as AUTO_STATES
from llmctl.spec.optimizer_states import canonical_states
from llmctl.spec.parallel import ENGINE_STRATEGIES, ParallelDims, canonical_strategy
from llmctl.spec.precision import PRECISION_HELP, policy
from llmctl.spec.setup import MemoryLevers, TrainSetup
from llmctl.spec.text import check_line

PLAN_VERSION = 1

# --- caps ----------------------------------------------------------------------------------------------------------
# The same quantities as command-line options share their caps (llmctl.bounds.LIMITS: the largest clusters,
# context windows and global batches published). The others:
MAX_STEPS = 10**9
"""Optimizer steps (max_steps, warm-up, intervals, a token budget's step count): 10^9 steps at 0.1 s each (a tiny
model) is three years of training; the longest published LLM runs take a few million steps."""
MAX_SEED = 2**64 - 1
"""torch.manual_seed takes an unsigned 64-bit seed; numpy's SeedSequence (the data order) refuses negative ones."""
MAX_LR = 1.0
"""AdamW moves every weight by about lr per step whatever the gradient's scale (Kingma & Ba 2015, sec. 2.1: the
effective step is bounded by the step size); weights start at ~0.02 (GPT-2's init), so lr >= 1 wipes them out in one
step. Published AdamW recipes use at most ~1e-2."""
MAX_PAD_VOCAB_MULTIPLE = 65_536
"""Megatron-LM pads to 128 x the tensor-parallel degree (1,024 at tp 8); past 64k the padding alone is a
vocabulary's worth of LM-head rows that are never a target."""
MAX_TEXT = 4096
"""PATH_MAX on Linux (limits.h): no path, and so no name or field of a plan, is longer."""
MAX_ECHO = 300
"""Characters of a user's key or value an error line repeats (a 1 MB unknown key is not worth a 1 MB line)."""


def _short(text: str, limit: int = MAX_ECHO) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _not_a_boolean(value: Any) -> Any:
    # YAML reads yes/no/true/false/on/off as booleans and pydantic's lax mode would take them as 1/0: `nodes: yes`
    # is a slip, not one node.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


def _no_nul(value: str, where: str = "") -> str:
    if "\x00" in value:
        raise ValueError(f"{where + ': ' if where else ''}contains a NUL byte (\\x00), which no path or name can hold")
    return value


# Every Int and Float field states both bounds (tests/cli/test_fuzz_planfile.py checks it): its own cap, else the
# command line's generic one (an integer that a float holds exactly, a float of magnitude <= 1e15). The bounds are
# on each field rather than in these aliases: pydantic lets an alias's Field bounds replace the field's own.
Int = Annotated[int, BeforeValidator(_not_a_boolean)]
"""An integer, never a boolean."""
Float = Annotated[float, BeforeValidator(_not_a_boolean)]
"""A finite float (the models' allow_inf_nan=False), never a boolean."""
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT), AfterValidator(check_line)]
"""A name or path: not empty (an empty path would silently mean the current folder), one line of printable text (no
control character: llmctl.spec.text), at most PATH_MAX."""

Sharding = Literal["full_shard", "hybrid_shard", "no_shard"]
"""llmctl.spec.parallel.ENGINE_STRATEGIES; older plans' `full` and `hybrid` are read as these."""


def _precision(v: Any) -> Any:
    """Any name or alias llmctl.spec.precision accepts, stored as the policy's own name (`fp16` -> fp16-mixed)."""
    if not isinstance(v, str):
        raise ValueError("expected a precision name (" + PRECISION_HELP + ")")
    try:
        return policy(v).name
    except LlmctlError as e:
        raise ValueError(str(e)) from None


Precision = Annotated[str, BeforeValidator(_precision)]
Attention = Literal["auto", "flash", "sdpa", "eager"]


def _checkpointing(v: Any) -> Any:
    if not isinstance(v, str):
        raise ValueError(f"expected one of {ckpt_modes.SPELLINGS}")
    try:
        return ckpt_modes.parse(v)
    except LlmctlError as e:
        raise ValueError(str(e)) from None


Checkpointing = Annotated[str, BeforeValidator(_checkpointing)]
"""llmctl.spec.checkpointing: none | selective | partial:K | full."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _check_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face config values (any JSON shape): numbers finite and within the generic caps, strings without NUL,
    at any depth. Walked with a stack, not recursion (the YAML reader caps the depth; this must not depend on it)."""
    stack: list[tuple[str, Any]] = [(k, v) for k, v in overrides.items()]
    while stack:
        where, v = stack.pop()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                check("", type(v), v)  # what the command line allows a number without a cap of its own
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        elif isinstance(v, str):
            _no_nul(v, where)
        elif isinstance(v, dict):
            stack += [(f"{where}.{k}", x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{where}.{i}", x) for i, x in enumerate(v)]
    return overrides


class ModelSection(_Strict):
    """Which model: exactly one of a preset name, a config.json path, or a local weights folder."""

    preset: Text | None = None
    config: Text | None = None
    """A Hugging Face config.json (file or folder), or a hub id (Qwen/Qwen3-8B: config.json from the local Hugging
    Face cache, or that one file downloaded); random init."""
    weights: Text | None = None
    """Path to a local Hugging Face model folder with weights."""
    overrides: Annotated[dict[str, Any], AfterValidator(_check_overrides)] = Field(default_factory=dict)
    """Hugging Face config fields to override (e.g. num_hidden_layers)."""
    pad_vocab_multiple: Int = Field(64, ge=1, le=MAX_PAD_VOCAB_MULTIPLE)
    """Pad the vocabulary to a multiple of this (tensor-core shapes; 64 on A100: docs/sources.md#fsdp-seed)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        given = [k for k in ("preset", "config", "weights") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of model.preset, model.config, model.weights (got {given or 'none'})")
        return self


class DataSection(_Strict):
    kind: Literal["text", "tokens", "synthetic"] = "text"
    """tokens: a dataset folder made by `llmctl data prepare` (memory-mapped shards; each rank reads only its
    blocks; the one token format); text: small local .txt/.jsonl files, tokenized whole on every rank at
    start; synthetic: random tokens (benchmarks)."""
    paths: list[Text] = Field(default_factory=list)
    tokenizer: Text | None = None
    """Local tokenizer folder; None uses the built-in byte-level tokenizer. With kind tokens: when given, it must be
    the tokenizer the data was prepared with (compared by fingerprint)."""
    jsonl_field: Text = "text"
    val: Literal["split"] | list[Text] | None = None
    """Validation data: `split` (the val split of the prepared folder in `paths`), or separate files of the same
    kind (text files; or prepared folders, read whole as their train split); None: no validation."""

    @model_validator(mode="after")
    def _paths(self) -> DataSection:
        if self.kind != "synthetic" and not self.paths:
            raise ValueError(f"data.paths is empty but data.kind is {self.kind!r}")
        if self.val == "split" and self.kind != "tokens":
            raise ValueError("data.val: split needs data.kind tokens (a folder made by `llmctl data prepare`)")
        if self.val is not None and self.kind == "synthetic":
            raise ValueError("data.val: synthetic data has no validation set")
        if isinstance(self.val, list) and not self.val:
            raise ValueError("data.val is an empty list (give files, `split`, or leave it out)")
        return self


def _gpu_kind(v: str) -> str:
    from llmctl.spec.hardware import gpu_kind  # the catalog's module: imported when a plan names a GPU

    return gpu_kind(v)


class HardwareSection(_Strict):
    """Where the plan was made for. gpu=None means CPU (gloo)."""

    gpu: Annotated[Text, AfterValidator(_gpu_kind)] | None = None
    """A GPU kind of the catalog, shipped or $LLMCTL_GPU_CATALOG's (llmctl.spec.hardware.gpu_kind: the kind sizes a
    SLURM job, so an unknown one is refused rather than written into a job script)."""
    nodes: Int = Field(1, ge=1, le=LIMITS["--nodes"])
    nproc_per_node: Int = Field(1, ge=1, le=LIMITS["--nproc-per-node"])
    """Processes (GPUs) per node."""


class ParallelSection(_Strict):
    """The friendly spelling of the parallel degrees; `Plan.parallel_dims` turns it into them (in one place)."""

    sharding: Sharding = "full_shard"
    """full_shard: FSDP2 over all ranks, dims (1, world); hybrid_shard: shard inside a node, replicate across
    nodes (2-D mesh), dims (world / shard_size, shard_size); no_shard: replicate everywhere (DDP-like), (world, 1)."""
    shard_size: Int | None = Field(None, ge=1, le=LIMITS["--gpus"])
    """hybrid_shard: data-parallel ranks per shard group (default: those of one node, nproc_per_node / tp).
    Replicate size = world / (tp x shard_size)."""
    tp: Int = Field(1, ge=1, le=LIMITS["--tp"])
    """Tensor-parallel degree, with sequence parallelism: tp consecutive ranks of a node split each layer's matmuls
    and share one micro-batch (training.micro_batch_size is per data-parallel rank, as in torchtitan)."""
    async_tp: bool = False
    """Async TP (CUDA only, with training.compile): TP's collectives micro-pipelined with its matmuls."""
    cp: Int = Field(1, ge=1, le=LIMITS["--cp"])
    """Context-parallel degree: each sequence is split over cp ranks (ring attention; laid out between the
    data-parallel ranks and tp, torchtitan's mesh order); a cp group shares one micro-batch and FSDP shards over
    the data-parallel ranks x cp."""
    cp_load_balance: bool = True
    """Head-tail split of causal sequences (rank i holds chunks i and 2cp-1-i of 2cp), so every rank does equal
    attention work."""
    cp_rotate: Literal["allgather", "alltoall"] = "allgather"
    """How keys/values go round the ring: one all-gather per attention (all held at once), or cp-1 neighbour
    exchanges (torch's set_rotate_method)."""
    offload: bool = False
    """CPU offload (FSDP2's CPUOffloadPolicy): sharded parameters, gradients, optimizer states and the optimizer step
    in host memory, each layer's shard copied to the GPU for its all-gather (llmctl.spec.setup.MemoryLevers)."""

    @field_validator("sharding", mode="before")
    @classmethod
    def _one_spelling(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return canonical_strategy(v, ENGINE_STRATEGIES)
        except LlmctlError as e:
            raise ValueError(str(e)) from None


class FinetuneSection(_Strict):
    """Full training, or low-rank adapters on a frozen base (llmctl.spec.finetune). Written only when not full, so
    older plans read and write as before."""

    method: Literal["full", "lora", "qlora"] = "full"
    lora_rank: Int = Field(16, ge=1, le=MAX_RANK)
    lora_alpha: Float = Field(32.0, gt=0, le=GENERIC_FLOAT_LIMIT)
    """The adapters' output is scaled by lora_alpha / lora_rank."""
    lora_dropout: Float = Field(0.0, ge=0, lt=1)
    lora_targets: list[Text] | None = None
    """Module names that get adapters (peft's target_modules); None: the model family's default (attention and MLP
    projections)."""

    @field_validator("method", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("lora_targets")
    @classmethod
    def _targets(cls, v: list[str] | None) -> list[str] | None:
        return v if v is None else check_target_list(v)

    @property
    def spec(self) -> Finetune:
        return Finetune(self.method, self.lora_rank, self.lora_alpha, self.lora_dropout, tuple(self.lora_targets or ()))


class TrainingSection(_Strict):
    precision: Precision = "bf16-mixed"
    micro_batch_size: Int = Field(1, ge=1, le=LIMITS["--micro-batch"])
    grad_accum_steps: Int = Field(1, ge=1, le=LIMITS["--global-batch"])
    """At most the largest global batch (in sequences): each accumulation step adds at least one sequence."""
    seq_len: Int = Field(1024, ge=8, le=LIMITS["--seq-len"])
    activation_checkpointing: Checkpointing = "none"
    """none | selective | partial:K | full (llmctl.spec.checkpointing)."""
    loss_chunk_tokens: Int = Field(0, ge=0, le=LIMITS["--loss-chunk"])
    """0: the LM head and loss run on the whole micro-batch (b*s*V logits, and their fp32 copy, exist at once).
    N > 0: over chunks of N tokens, each recomputed in backward, so only one chunk's logits exist at a time."""
    attention: Attention = "auto"
    compile: bool = False
    max_steps: Int | None = Field(None, ge=1, le=MAX_STEPS)
    token_budget: Int | None = Field(None, ge=1, le=MAX_TOKENS)
    """Train for this many tokens instead of max_steps (steps = ceil(budget / tokens per step))."""
    seed: Int = Field(0, ge=0, le=MAX_SEED)
    grad_clip: Float | None = Field(1.0, gt=0, le=GENERIC_FLOAT_LIMIT)

    @model_validator(mode="after")
    def _length(self) -> TrainingSection:
        if (self.max_steps is None) == (self.token_budget is None):
            raise ValueError("give exactly one of training.max_steps and training.token_budget")
        return self


Beta = Annotated[float, BeforeValidator(_not_a_boolean), Field(ge=0, lt=1)]
"""An Adam moment decay: torch.optim.AdamW refuses one outside [0, 1)."""


class OptimizerSection(_Strict):
    name: Literal["adamw"] = "adamw"
    lr: Float = Field(3e-4, gt=0, le=MAX_LR)
    weight_decay: Float = Field(0.1, ge=0, le=GENERIC_FLOAT_LIMIT)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: Float = Field(1e-8, gt=0, le=GENERIC_FLOAT_LIMIT)
    warmup_steps: Int = Field(0, ge=0, le=MAX_STEPS)
    min_lr_ratio: Float = Field(0.1, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio."""
    states: Literal["auto", "fp32", "bf16", "8bit"] = "auto"
    """What the two moments are stored in (llmctl.spec.optimizer_states): auto (the precision's own), fp32, bf16, or
    8bit (torchao's AdamW8bit, extra [fp8]). Written only when not auto, so older plans read and write as before."""

    @field_validator("states", mode="before")
    @classmethod
    def _states(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return canonical_states(v)
        except LlmctlError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _decay(self) -> OptimizerSection:
        # Decoupled weight decay multiplies every weight by (1 - lr * weight_decay) each step (Loshchilov & Hutter
        # 2019, alg. 2; torch.optim.AdamW): at lr * weight_decay >= 1 the weights are zeroed or flip sign.
        if self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"optimizer.weight_decay {self.weight_decay:g} x optimizer.lr {self.lr:g} is >= 1: "
                "each step would shrink the weights to zero or past it"
            )
        return self


class CheckpointSection(_Strict):
    dir: Text | None = None
    """None disables checkpoints."""
    interval_steps: Int = Field(100, ge=1, le=MAX_STEPS)
    keep_last: Int = Field(2, ge=1, le=MAX_STEPS)


class WandbSection(_Strict):
    """Weights & Biases (extra [logging]). The API key only ever comes from the environment (WANDB_API_KEY or
    `wandb login`); a plan cannot hold it."""

    project: Text
    name: Text | None = None
    """The run's display name (default: the plan's name)."""
    entity: Text | None = None
    mode: Literal["online", "offline", "disabled"] = "online"
    """offline: written under logging.dir/wandb, synced later with `wandb sync` (no network needed)."""
    tags: list[Text] = Field(default_factory=list)


class LoggingSection(_Strict):
    dir: Text = "runs/llmctl"
    interval_steps: Int = Field(1, ge=1, le=MAX_STEPS)
    eval_interval_steps: Int = Field(0, ge=0, le=MAX_STEPS)
    """With data.val: the validation loss every N steps and at the last step (0: at the last step only)."""
    eval_batches: Int = Field(8, ge=1, le=MAX_STEPS)
    """Validation set: the first eval_batches x (global batch) sequences of data.val, in order; the same sequences
    on any world size with the same global batch, and after a resume."""
    tensorboard: bool = False
    """Event files under logging.dir/tensorboard (rank 0; extra [logging])."""
    wandb: WandbSection | None = None
    check_after_steps: Int = Field(5, ge=0, le=MAX_STEPS)
    """Measured vs `predicted`, once: the first logged window starting this many steps after the (re)start, past
    compile and warm-up, is compared with the plan (a `plan_check` event; a warning when off). 0: never."""
    check_slower: Float = Field(0.3, gt=0, lt=1)
    """Warn when tokens/s is more than this fraction below the prediction."""
    check_memory: Float = Field(0.1, gt=0, le=GENERIC_FLOAT_LIMIT)
    """Warn when peak reserved GPU memory is more than this fraction above the prediction."""


class Predicted(_Strict):
    """What `llmctl plan` predicted; the engine logs its measurements next to these."""

    tokens_per_s: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    tokens_per_s_per_gpu: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    mfu: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    step_time_s: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    memory_per_gpu_bytes: Int | None = Field(None, ge=0, le=GENERIC_INT_LIMIT)
    intra_node_busbw_gbytes_s: Float | None = Field(None, gt=0, le=GENERIC_FLOAT_LIMIT)
    """The intra-node bus bandwidth per GPU the prediction assumed, GB/s (the launch preflight compares with it)."""
    inter_node_busbw_gbytes_s: Float | None = Field(None, gt=0, le=GENERIC_FLOAT_LIMIT)
    """A node's inter-node bus bandwidth (all its NICs) the prediction assumed, GB/s (None: one node)."""


class Plan(_Strict):
    version: Int = Field(PLAN_VERSION, ge=-GENERIC_INT_LIMIT, le=GENERIC_INT_LIMIT)
    name: Text = "llmctl-run"
    model: ModelSection
    data: DataSection = Field(default_factory=lambda: DataSection(kind="synthetic"))
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    training: TrainingSection
    finetune: FinetuneSection = Field(default_factory=FinetuneSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    predicted: Predicted = Field(default_factory=Predicted)

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.version != PLAN_VERSION:
            raise ValueError(f"version {self.version} is not supported (this llmctl reads version {PLAN_VERSION})")
        par = self.parallel
        if self.world_size % par.tp:
            raise ValueError(f"parallel.tp {par.tp} does not divide the world size {self.world_size}")
        if self.world_size % (par.tp * par.cp):
            raise ValueError(
                f"parallel.cp {par.cp} x parallel.tp {par.tp} does not divide the world size {self.world_size}"
            )
        dp = self.world_size // (par.tp * par.cp)
        if par.sharding == "hybrid_shard":
            shard = par.shard_size or max(1, self.hardware.nproc_per_node // (par.tp * par.cp))
            if dp % shard:
                raise ValueError(f"parallel.shard_size {shard} does not divide the {dp} data-parallel ranks")
        elif par.shard_size is not None:
            raise ValueError("parallel.shard_size is only meaningful with parallel.sharding: hybrid_shard")
        if self.training.attention == "flash" and not policy(self.training.precision).flash_attention:
            raise ValueError("training.attention: flash needs bf16 or fp16 (flash-attention has no fp32 kernel)")
        if self.finetune.method != "full":
            try:
                self.setup  # noqa: B018 - the setup's refusals of what adapters do not run with, as one line
            except LlmctlError as e:
                raise ValueError(f"finetune.method: {e}") from None
        self._sizes()
        self._model()
        return self

    def _sizes(self) -> None:
        """Products of fields that are each within their caps can still be absurd: the same caps, on the products."""
        hw, t = self.hardware, self.training
        world = self.world_size
        if world > LIMITS["--gpus"]:
            raise ValueError(
                f"hardware.nodes {hw.nodes} x hardware.nproc_per_node {hw.nproc_per_node} = {world:,} ranks, "
                f"more than {int(LIMITS['--gpus']):,}"
            )
        dp = world // (self.parallel.tp * self.parallel.cp)  # data-parallel ranks (a tp x cp block shares a batch)
        sequences = t.micro_batch_size * t.grad_accum_steps * dp
        if sequences > LIMITS["--global-batch"]:
            raise ValueError(
                f"training.micro_batch_size x training.grad_accum_steps x {dp} data-parallel ranks = {sequences:,} "
                "sequences "
                f"per step, more than {int(LIMITS['--global-batch']):,}"
            )
        if self.tokens_per_step > LIMITS["--global-batch-tokens"]:
            raise ValueError(
                f"training.seq_len {t.seq_len} x {sequences:,} sequences = {self.tokens_per_step:,} tokens per step, "
                f"more than {int(LIMITS['--global-batch-tokens']):,}"
            )
        if self.total_steps > MAX_STEPS:
            raise ValueError(
                f"training.token_budget {t.token_budget:,} at {self.tokens_per_step:,} tokens per step is "
                f"{self.total_steps:,} steps, more than {MAX_STEPS:,}"
            )

    def _model(self) -> None:
        """A preset with its overrides is known here: the model the engine would build, checked now. (A config or
        weights path is read where the run starts: the file may exist on the cluster only.)"""
        m = self.model
        if not m.preset:
            return
        from llmctl.spec.models import SIZE_FIELDS, from_hf_config, preset_entry
        from llmctl.spec.rope import merge_overrides

        try:
            entry = preset_entry(m.preset)
        except LlmctlError as e:
            raise ValueError(f"model.preset: {e}") from None
        for key, v in m.overrides.items():
            # The overrides reach transformers as they are: a size of 2.0 or "8" would fail there (range(2.0)).
            if key in SIZE_FIELDS and v is not None and type(v) is not int:
                raise ValueError(f"model.overrides.{key}: expected an integer, got {_short(repr(v), 60)}")
        where = "model.overrides" if m.overrides else "model.preset"
        try:  # the engine's own merge (llmctl.engine.model.base_spec)
            spec = from_hf_config(merge_overrides(entry["config"], m.overrides), name=where, source="preset")
        except LlmctlError as e:
            raise ValueError(str(e)) from None
        if spec.params > MAX_PARAMS:
            raise ValueError(f"{where}: a model of {spec.params:,} parameters, more than {MAX_PARAMS:.0e}")
        if self.parallel.tp > 1:
            from llmctl.families.tensor_parallel import plan_problem

            problem = plan_problem(spec, self.parallel.tp)
            if problem:
                raise ValueError(f"parallel.tp: {problem}")
        if self.parallel.cp > 1:
            from llmctl.families.context_parallel import cp_problem

            problem = cp_problem(spec, self.training.seq_len)
            if problem:
                raise ValueError(f"parallel.cp: {problem}")
        if spec.is_gpt2 and self.training.seq_len > spec.max_position_embeddings:
            # GPT-2 learns one embedding per position (wpe): a longer sequence indexes past the table.
            raise ValueError(
                f"training.seq_len {self.training.seq_len} is longer than the model's "
                f"{spec.max_position_embeddings} positions (n_positions; set it in model.overrides)"
            )

    @property
    def world_size(self) -> int:
        return self.hardware.nodes * self.hardware.nproc_per_node

    @property
    def setup(self) -> TrainSetup:
        """The plan's training setup: the one place the parallel, hardware and training sections become one."""
        hw, par, t = self.hardware, self.parallel, self.training
        default_shard = max(1, hw.nproc_per_node // (par.tp * par.cp))
        shard = (par.shard_size or default_shard) if par.sharding == "hybrid_shard" else None
        return TrainSetup(
            tp=par.tp,
            async_tp=par.async_tp,
            cp=par.cp,
            cp_load_balance=par.cp_load_balance,
            cp_rotate=par.cp_rotate,
            precision=t.precision,
            optimizer=self.optimizer.name,
            optimizer_states=self.optimizer.states,
            strategy=par.sharding,
            nodes=hw.nodes,
            gpus_per_node=hw.nproc_per_node,
            shard_size=shard,
            micro_batch_size=t.micro_batch_size,
            grad_accum_steps=t.grad_accum_steps,
            seq_len=t.seq_len,
            checkpointing=t.activation_checkpointing,
            attention=t.attention,
            compile=t.compile,
            loss_chunk_tokens=t.loss_chunk_tokens,
            levers=MemoryLevers(offload=par.offload),
            finetune=self.finetune.spec,
        )

    def with_setup(self, setup: TrainSetup, source: str = "the plan") -> Plan:
        """This plan with `setup`'s layout and training decisions, everything else as it is (validated as a file
        read from disk would be: one SpecError line naming `source`). The inverse of `setup`."""
        data = self.model_dump(mode="json")
        sections = setup_sections(setup)
        if sections["parallel"]["shard_size"] is None and self.parallel.shard_size == setup.shard_size:
            sections["parallel"]["shard_size"] = self.parallel.shard_size  # as the file spelled it
        for key, values in sections.items():
            data[key].update(values)
        return plan_from_dict(data, source)

    @property
    def parallel_dims(self) -> ParallelDims:
        """The plan's parallel degrees (its setup's)."""
        return self.setup.dims

    @property
    def tokens_per_step(self) -> int:
        return self.setup.tokens_per_step

    @property
    def total_steps(self) -> int:
        t = self.training
        if t.max_steps is not None:
            return t.max_steps
        assert t.token_budget is not None
        return -(-t.token_budget // self.tokens_per_step)


def setup_sections(setup: TrainSetup) -> dict[str, dict[str, Any]]:
    """The plan file's fields that a setup decides, by section: what `Plan.with_setup` and `llmctl plan` write (the
    inverse of `Plan.setup`)."""
    hybrid = setup.strategy == "hybrid_shard"
    return {
        "hardware": {"nodes": setup.nodes, "nproc_per_node": setup.gpus_per_node},
        "parallel": {
            "sharding": setup.strategy,
            # A shard group of one node is the default; another size is spelled out.
            "shard_size": setup.shard_size
            if hybrid and setup.shard_size not in (None, max(1, setup.gpus_per_node // (setup.tp * setup.cp)))
            else None,
            "tp": setup.tp,
            "async_tp": setup.async_tp,
            "cp": setup.cp,
            "cp_load_balance": setup.cp_load_balance,
            "cp_rotate": setup.cp_rotate,
            "offload": setup.levers.offload,
        },
        "training": {
            "precision": setup.precision.name,
            "micro_batch_size": setup.micro_batch_size,
            "grad_accum_steps": setup.grad_accum_steps,
            "seq_len": setup.seq_len,
            "activation_checkpointing": setup.checkpointing,
            "loss_chunk_tokens": setup.loss_chunk_tokens,
            "attention": setup.attention,
            "compile": setup.compile,
        },
        "optimizer": {"states": setup.optimizer_states},
        "finetune": plan_fields(setup.finetune),
    }


def _key(part: int | str) -> str:
    """A key as the line shows it: quoted when it would not be seen (empty, or spaces at an end: `seq_len `)."""
    if isinstance(part, str) and (not part or part != part.strip()):
        return repr(part)
    return _short(str(part), 60)


def error_line(err: ValidationError, source: str) -> str:
    """The first validation error as one line: source, the key path, what is wrong, how many more there are."""
    first = err.errors()[0]
    loc = ".".join(_key(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    msg = _short(msg.removeprefix("Value error, "))
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return one_line(f"{source}: {loc + ': ' if loc else ''}{msg}{more}")


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a plan must be a YAML mapping, got {type(data).__name__}")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise SpecError(error_line(e, source)) from None


def load_plan(path: str | os.PathLike[str]) -> Plan:
    p = Path(path)
    return plan_from_dict(load_yaml(p, "plan file"), source=str(p))


def plan_to_yaml(plan: Plan) -> str:
    data = plan.model_dump(mode="json", exclude_none=False)
    if data["optimizer"]["states"] == AUTO_STATES:
        del data["optimizer"]["states"]  # the default: a plan that does not ask reads as plans always have
    if not data["parallel"]["offload"]:
        del data["parallel"]["offload"]  # likewise
    if data["finetune"]["method"] == "full":
        del data["finetune"]  # likewise
    return yaml.safe_dump(data, sort_keys=False)


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    write_atomic(path, plan_to_yaml(plan))
