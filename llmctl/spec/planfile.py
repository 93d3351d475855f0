"""The plan file: the one schema shared by `llmctl plan` (writes it), `llmctl launch` (submits it) and the engine
(runs it). YAML on disk, validated here and nowhere else. Torch-free.

Unknown keys are rejected (extra="forbid"), and impossible combinations are rejected naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmctl.errors import LlmctlError, SpecError
from llmctl.fileio import load_yaml, write_atomic
from llmctl.spec.parallel import ENGINE_STRATEGIES, ParallelDims, canonical_strategy

PLAN_VERSION = 1

Sharding = Literal["full_shard", "hybrid_shard", "no_shard"]
"""llmctl.spec.parallel.ENGINE_STRATEGIES; older plans' `full` and `hybrid` are read as these."""
Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16"]
Attention = Literal["auto", "flash", "sdpa", "eager"]
Checkpointing = Literal["none", "full"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Strict):
    """Which model: exactly one of a preset name, a config.json path, or a local weights folder."""

    preset: str | None = None
    config: str | None = None
    """Path to a Hugging Face config.json (file or folder); random init."""
    weights: str | None = None
    """Path to a local Hugging Face model folder with weights."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Hugging Face config fields to override (e.g. num_hidden_layers)."""
    pad_vocab_multiple: int = Field(64, ge=1)
    """Pad the vocabulary to a multiple of this (tensor-core shapes; 64 on A100: docs/sources.md#fsdp-seed)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        given = [k for k in ("preset", "config", "weights") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of model.preset, model.config, model.weights (got {given or 'none'})")
        return self


class DataSection(_Strict):
    kind: Literal["text", "tokens", "synthetic"] = "text"
    """text: local .txt/.jsonl files tokenized on the fly; tokens: a memory-mapped .bin token file; synthetic:
    random tokens (benchmarks)."""
    paths: list[str] = Field(default_factory=list)
    tokenizer: str | None = None
    """Local tokenizer folder; None uses the built-in byte-level tokenizer."""
    jsonl_field: str = "text"

    @model_validator(mode="after")
    def _paths(self) -> DataSection:
        if self.kind != "synthetic" and not self.paths:
            raise ValueError(f"data.paths is empty but data.kind is {self.kind!r}")
        return self


class HardwareSection(_Strict):
    """Where the plan was made for. gpu=None means CPU (gloo)."""

    gpu: str | None = None
    nodes: int = Field(1, ge=1)
    nproc_per_node: int = Field(1, ge=1)
    """Processes (GPUs) per node."""


class ParallelSection(_Strict):
    """The friendly spelling of the parallel degrees; `Plan.parallel_dims` turns it into them (in one place)."""

    sharding: Sharding = "full_shard"
    """full_shard: FSDP2 over all ranks, dims (1, world); hybrid_shard: shard inside a node, replicate across
    nodes (2-D mesh), dims (world / shard_size, shard_size); no_shard: replicate everywhere (DDP-like), (world, 1)."""
    shard_size: int | None = Field(None, ge=1)
    """hybrid_shard: ranks per shard group (default: nproc_per_node). Replicate size = world / shard_size."""

    @field_validator("sharding", mode="before")
    @classmethod
    def _one_spelling(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return canonical_strategy(v, ENGINE_STRATEGIES)
        except LlmctlError as e:
            raise ValueError(str(e)) from None


class TrainingSection(_Strict):
    precision: Precision = "bf16-mixed"
    micro_batch_size: int = Field(1, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    seq_len: int = Field(1024, ge=8)
    activation_checkpointing: Checkpointing = "none"
    attention: Attention = "auto"
    compile: bool = False
    max_steps: int | None = Field(None, ge=1)
    token_budget: int | None = Field(None, ge=1)
    """Train for this many tokens instead of max_steps (steps = ceil(budget / tokens per step))."""
    seed: int = 0
    grad_clip: float | None = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _length(self) -> TrainingSection:
        if (self.max_steps is None) == (self.token_budget is None):
            raise ValueError("give exactly one of training.max_steps and training.token_budget")
        return self


class OptimizerSection(_Strict):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Cosine decay ends at lr * min_lr_ratio."""


class CheckpointSection(_Strict):
    dir: str | None = None
    """None disables checkpoints."""
    interval_steps: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)


class LoggingSection(_Strict):
    dir: str = "runs/llmctl"
    interval_steps: int = Field(1, ge=1)


class Predicted(_Strict):
    """What `llmctl plan` predicted; the engine logs its measurements next to these."""

    tokens_per_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    memory_per_gpu_bytes: int | None = None


class Plan(_Strict):
    version: int = PLAN_VERSION
    name: str = "llmctl-run"
    model: ModelSection
    data: DataSection = Field(default_factory=lambda: DataSection(kind="synthetic"))
    hardware: HardwareSection = Field(default_factory=HardwareSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    training: TrainingSection
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    predicted: Predicted = Field(default_factory=Predicted)

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.version != PLAN_VERSION:
            raise ValueError(f"version {self.version} is not supported (this llmctl reads version {PLAN_VERSION})")
        par = self.parallel
        if par.sharding == "hybrid_shard":
            shard = par.shard_size or self.hardware.nproc_per_node
            if self.world_size % shard:
                raise ValueError(f"parallel.shard_size {shard} does not divide the world size {self.world_size}")
        elif par.shard_size is not None:
            raise ValueError("parallel.shard_size is only meaningful with parallel.sharding: hybrid_shard")
        if self.training.attention == "flash" and self.training.precision == "fp32":
            raise ValueError("training.attention: flash needs bf16 or fp16 (flash-attention has no fp32 kernel)")
        return self

    @property
    def world_size(self) -> int:
        return self.hardware.nodes * self.hardware.nproc_per_node

    @property
    def parallel_dims(self) -> ParallelDims:
        """The plan's parallel degrees: the one place `parallel.sharding` becomes degrees."""
        hw, par = self.hardware, self.parallel
        shard = (par.shard_size or hw.nproc_per_node) if par.sharding == "hybrid_shard" else None
        return ParallelDims.from_strategy(par.sharding, hw.nodes, hw.nproc_per_node, shard_size=shard)

    @property
    def tokens_per_step(self) -> int:
        t = self.training
        return self.parallel_dims.tokens_per_step(t.micro_batch_size, t.grad_accum_steps, t.seq_len)

    @property
    def total_steps(self) -> int:
        t = self.training
        if t.max_steps is not None:
            return t.max_steps
        assert t.token_budget is not None
        return -(-t.token_budget // self.tokens_per_step)


def _error_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    msg = msg.removeprefix("Value error, ")
    more = f" (+{len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{source}: {loc + ': ' if loc else ''}{msg}{more}"


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a plan must be a YAML mapping, got {type(data).__name__}")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        raise SpecError(_error_line(e, source)) from None


def load_plan(path: str | os.PathLike[str]) -> Plan:
    p = Path(path)
    return plan_from_dict(load_yaml(p, "plan file"), source=str(p))


def plan_to_yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.model_dump(mode="json", exclude_none=False), sort_keys=False)


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    write_atomic(path, plan_to_yaml(plan))
