"""The plan file: the one schema shared by `llmctl plan` (writes it), `llmctl launch` (submits it) and the engine
(runs it). YAML on disk, validated here and nowhere else. Torch-free.

Unknown keys are rejected (extra="forbid"), and impossible combinations are rejected naming the key. Every number
is finite and within a documented cap (the command line's caps, `llmctl.bounds`, where the same quantity has
one): a plan the engine would choke on hours later, or after torch has started, fails here in one line instead.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)

from llmctl.bounds import GENERIC_FLOAT_LIMIT, GENERIC_INT_LIMIT, LIMITS, check
from llmctl.errors import LlmctlError, RuleError, SpecError, one_line
from llmctl.fileio import load_yaml, write_atomic
from llmctl.spec import decisions, rules
from llmctl.spec.decisions import Decision
from llmctl.spec.fields import Beta, Float, Int, Text, no_nul
from llmctl.spec.models import MAX_PARAMS, MAX_TOKENS
from llmctl.spec.parallel import ParallelDims
from llmctl.spec.setup import TrainSetup

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
MAX_ECHO = 300
"""Characters of a user's key or value an error line repeats (a 1 MB unknown key is not worth a 1 MB line)."""


def _short(text: str, limit: int = MAX_ECHO) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Strict(BaseModel):
    # Frozen: a plan is read, checked and its setup derived once (`Plan.setup`); a changed plan is a new one
    # (`Plan.with_setup`, `plan_from_dict`), checked again.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _decision_field(d: Decision) -> tuple[Any, Any]:
    """A decision as a plan-file field (llmctl.spec.decisions): its type, default, help and older keys."""
    alias = AliasChoices(d.file_key, *d.aliases) if d.aliases else None
    return d.file_type, Field(d.plan_file_default, description=d.help, validation_alias=alias, **d.bounds)


def _section(
    name: str,
    doc: str,
    key: str,
    own: dict[str, tuple[Any, Any]] | None = None,
    order: tuple[str, ...] = (),
    validators: dict[str, Any] | None = None,
) -> Any:
    """A plan-file section: the setup's decisions filed under `key` (declared once, in llmctl.spec.setup) and the
    section's own keys, in `order` (the keys not named there: decisions first, in their declared order)."""
    fields = {d.file_key: _decision_field(d) for d in decisions.in_section(TrainSetup, key)}
    fields.update(own or {})
    ordered = [k for k in order if k in fields] + [k for k in fields if k not in order]
    return create_model(  # type: ignore[call-overload]
        name,
        __base__=_Strict,
        __doc__=doc,
        __module__=__name__,
        __validators__=validators or {},
        **{k: fields[k] for k in ordered},
    )


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
            no_nul(v, where)
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


# --- the sections that hold the setup's decisions (their keys: llmctl.spec.setup) --------------------------------
def _gpu_kind(v: str) -> str | None:
    """A catalog kind as it is; the CPU (`cpu`, presets/cpu.yaml) as None: a plan on the host's cores runs on gloo,
    and every reader of the plan asks `hardware.gpu` whether there is a GPU."""
    from llmctl.spec.hardware import gpu_kind, resolve_gpu  # the catalog's module: imported when a plan names a GPU

    return None if resolve_gpu(gpu_kind(v)).is_cpu else v


HardwareSection = _section(
    "HardwareSection",
    "Where the plan was made for. gpu=None (or cpu) means CPU (gloo).",
    "hardware",
    own={
        "gpu": (
            Annotated[Text, AfterValidator(_gpu_kind)] | None,
            Field(
                None,
                description="A GPU kind of the catalog, shipped or $LLMCTL_GPU_CATALOG's "
                "(llmctl.spec.hardware.gpu_kind: the kind sizes a SLURM job, so an unknown one is refused rather "
                "than written into a job script).",
            ),
        )
    },
    order=("gpu",),
)
ParallelSection = _section(
    "ParallelSection",
    "The friendly spelling of the parallel degrees; `Plan.setup` turns it into them (in one place).",
    "parallel",
)
FinetuneSection = _section(
    "FinetuneSection",
    "Full training, or low-rank adapters on a frozen base (llmctl.spec.finetune). Written only when not full, so "
    "older plans read and write as before.",
    "finetune",
)


def _length(section: Any) -> Any:
    if (section.max_steps is None) == (section.token_budget is None):
        raise ValueError("give exactly one of training.max_steps and training.token_budget")
    return section


TrainingSection = _section(
    "TrainingSection",
    "How long and how the run trains: the setup's training decisions, its length, seed and clipping.",
    "training",
    own={
        "max_steps": (Int | None, Field(None, ge=1, le=MAX_STEPS)),
        "token_budget": (
            Int | None,
            Field(
                None,
                ge=1,
                le=MAX_TOKENS,
                description="Train for this many tokens instead of max_steps (steps = ceil(budget / tokens per step)).",
            ),
        ),
        "seed": (Int, Field(0, ge=0, le=MAX_SEED)),
        "grad_clip": (Float | None, Field(1.0, gt=0, le=GENERIC_FLOAT_LIMIT)),
    },
    validators={"_length": model_validator(mode="after")(_length)},
)


def _decay(section: Any) -> Any:
    # Decoupled weight decay multiplies every weight by (1 - lr * weight_decay) each step (Loshchilov & Hutter
    # 2019, alg. 2; torch.optim.AdamW): at lr * weight_decay >= 1 the weights are zeroed or flip sign.
    if section.lr * section.weight_decay >= 1:
        raise ValueError(
            f"optimizer.weight_decay {section.weight_decay:g} x optimizer.lr {section.lr:g} is >= 1: "
            "each step would shrink the weights to zero or past it"
        )
    return section


OptimizerSection = _section(
    "OptimizerSection",
    "AdamW's hyper-parameters and schedule (linear warm-up, then cosine decay), and what its moments are kept in.",
    "optimizer",
    own={
        "lr": (Float, Field(3e-4, gt=0, le=MAX_LR)),
        "weight_decay": (Float, Field(0.1, ge=0, le=GENERIC_FLOAT_LIMIT)),
        "betas": (tuple[Beta, Beta], Field((0.9, 0.95))),
        "eps": (Float, Field(1e-8, gt=0, le=GENERIC_FLOAT_LIMIT)),
        "warmup_steps": (Int, Field(0, ge=0, le=MAX_STEPS)),
        "min_lr_ratio": (Float, Field(0.1, ge=0, le=1, description="Cosine decay ends at lr * min_lr_ratio.")),
    },
    order=("name", "lr", "weight_decay", "betas", "eps", "warmup_steps", "min_lr_ratio", "states"),
    validators={"_decay": model_validator(mode="after")(_decay)},
)


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


class WatchdogSection(_Strict):
    """A hung run (llmctl.launch.heartbeat): when it counts as STALLED, and how long a collective may wait before the
    ranks give up. Written to a plan file only when not at these defaults."""

    stall_factor: Float = Field(3.0, gt=1, le=GENERIC_FLOAT_LIMIT)
    """STALLED when no rank moved for this many step times (measured by the ranks, else predicted.step_time_s)."""
    stall_floor_s: Float = Field(60.0, gt=0, le=GENERIC_FLOAT_LIMIT)
    """Never STALLED before this many seconds of quiet (start-up, the first compile, a checkpoint)."""
    collective_timeout_s: Float | None = Field(None, gt=0, le=GENERIC_FLOAT_LIMIT)
    """The process group's timeout: how long a rank waits in a collective before the run ends with one line. None:
    10 x predicted.step_time_s, at least 600 s (instead of NCCL's 10 and gloo's 30 minutes)."""

    def timeout_s(self, predicted_step_s: float | None) -> float:
        if self.collective_timeout_s is not None:
            return self.collective_timeout_s
        return max(DEFAULT_COLLECTIVE_TIMEOUT_S, 10 * (predicted_step_s or 0.0))


DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""The floor of a derived collective timeout: a checkpoint save of a large model, a first compile, a slow data
loader's first batch all fit in it."""


class Predicted(_Strict):
    """What `llmctl plan` predicted; the engine logs its measurements next to these."""

    tokens_per_s: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    tokens_per_s_per_gpu: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    mfu: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    """Model FLOPs utilisation with causal attention counted half, the FLOPs the kernels run (the engine's `mfu`)."""
    mfu_palm: Float | None = Field(None, ge=0, le=GENERIC_FLOAT_LIMIT)
    """The same with attention counted whole (PaLM, torchtitan), for comparing with published MFU (the engine's
    `mfu_palm`)."""
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
    watchdog: WatchdogSection = Field(default_factory=WatchdogSection)

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.version != PLAN_VERSION:
            raise ValueError(f"version {self.version} is not supported (this llmctl reads version {PLAN_VERSION})")
        try:
            setup = self.setup  # the setup's rules (llmctl.spec.rules), as one line naming the key
        except RuleError as e:
            raise ValueError(f"{file_key(e.decisions)}: {e}") from None
        if (err := rules.engine_problem(setup)) is not None:
            raise ValueError(f"{file_key(err.decisions)}: {err}")
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
        dp = self.setup.dims.dp  # data-parallel ranks (a tp x cp block shares a batch)
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
        if (err := rules.model_problem(self.setup, spec)) is not None:
            raise ValueError(f"{file_key(err.decisions)}: {err}")

    @property
    def world_size(self) -> int:
        return self.hardware.nodes * self.hardware.nproc_per_node

    @cached_property
    def setup(self) -> TrainSetup:
        """The plan's training setup: the one place the sections become one (each decision's key: its declaration in
        llmctl.spec.setup). A hybrid shard group is spelled out (the plan's default: the data-parallel ranks of one
        node)."""
        given: dict[str, Any] = {}
        for d in decisions.declared(TrainSetup):
            if d.in_file:
                v = getattr(getattr(self, d.section), d.file_key)
                given[d.name] = d.to_setup(v) if d.to_setup else v
        hybrid = given["strategy"] == "hybrid_shard"
        default_shard = max(1, given["gpus_per_node"] // (given["tp"] * given["cp"]))
        given["shard_size"] = (given["shard_size"] or default_shard) if hybrid else given["shard_size"]
        return decisions.with_values(TrainSetup(), **given)

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


def file_key(names: tuple[str, ...]) -> str:
    """The plan-file key of the first of these decisions the plan file holds (`tp` -> parallel.tp)."""
    keys = {d.name: d.key for d in decisions.declared(TrainSetup) if d.in_file}
    return next((keys[n] for n in names if n in keys), "parallel")


def setup_sections(setup: TrainSetup) -> dict[str, dict[str, Any]]:
    """The plan file's fields that a setup decides, by section: what `Plan.with_setup` and `llmctl plan` write (the
    inverse of `Plan.setup`)."""
    out: dict[str, dict[str, Any]] = {}
    for d in decisions.declared(TrainSetup):
        if d.in_file:
            v = decisions.get(setup, d)
            out.setdefault(d.section, {})[d.file_key] = d.to_file(v) if d.to_file else v
    # A shard group of one node is the default; another size is spelled out.
    one_node = max(1, setup.gpus_per_node // setup.dims.batch_sharers)
    hybrid = setup.strategy == "hybrid_shard"
    out["parallel"]["shard_size"] = setup.shard_size if hybrid and setup.shard_size not in (None, one_node) else None
    return out


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
    """A plan file, validated, with its relative paths resolved against its folder (`resolved`)."""
    p = Path(path)
    return resolved(plan_from_dict(load_yaml(p, "plan file"), source=str(p)), p.parent, str(p))


def resolved(plan: Plan, folder: str | os.PathLike[str], source: str = "plan") -> Plan:
    """`plan` as a file in `folder` means it: its relative paths resolved against that folder (llmctl.spec.planpaths;
    every reader of a plan file sees the same absolute paths, wherever it runs from). After validation, so that the
    schema's defaults (logging.dir) are resolved too."""
    from llmctl.spec import planpaths

    return plan_from_dict(planpaths.resolve(plan.model_dump(mode="json"), folder, source), source=source)


def plan_to_yaml(plan: Plan) -> str:
    data = plan.model_dump(mode="json", exclude_none=False)
    for d in decisions.declared(TrainSetup):
        # A decision written only when asked (offload, optimizer states, pp): at its default a plan reads as plans
        # always have.
        if d.in_file and not d.write_default and data[d.section].get(d.file_key) == d.plan_file_default:
            del data[d.section][d.file_key]
    if data["finetune"]["method"] == "full":
        del data["finetune"]  # likewise
    if data["watchdog"] == WatchdogSection().model_dump(mode="json"):
        del data["watchdog"]
    return yaml.safe_dump(data, sort_keys=False)


def save_plan(plan: Plan, path: str | os.PathLike[str]) -> None:
    write_atomic(path, plan_to_yaml(plan))
