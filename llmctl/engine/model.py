"""Build the Hugging Face causal LM a plan names: device and backend choice, attention kernel, padded vocabulary.

The selection functions are pure (they take what the machine has as arguments) so that the GPU paths are tested
on a CPU-only machine.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmctl.errors import InputError, SpecError
from llmctl.spec.attention import FALLBACK, Attention
from llmctl.spec.models import (
    ModelSpec,
    from_config_path,
    from_config_ref,
    from_hf_config,
    from_preset,
    spec_from_measurement,
)
from llmctl.spec.rules import model_problem

if TYPE_CHECKING:
    import torch

    from llmctl.engine.materialize import Slot
    from llmctl.spec.planfile import ModelSection
    from llmctl.spec.setup import TrainSetup

log = logging.getLogger("llmctl.engine")


@dataclass(frozen=True)
class DeviceChoice:
    device: str
    """"cuda:<local_rank>" or "cpu"."""
    backend: str
    """Process-group backend: nccl on CUDA, gloo on CPU."""


def select_device(cuda_available: bool, local_rank: int) -> DeviceChoice:
    """CUDA + NCCL when the machine has GPUs, else CPU + gloo."""
    if cuda_available:
        return DeviceChoice(device=f"cuda:{local_rank}", backend="nccl")
    return DeviceChoice(device="cpu", backend="gloo")


def flash_attn_importable() -> bool:
    """flash-attn 2 is installed (without importing it: its import initialises CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


def select_attention(
    requested: str | Attention, cuda_available: bool, flash_available: bool, cp: int = 1
) -> tuple[str, str]:
    """Plan attention -> (transformers attn_implementation, why). `flash` where it cannot run fails fast. With
    context parallelism, SDPA (torch's ring attention runs on SDPA's kernels: flash's algorithm on a GPU)."""
    try:
        kernel = Attention(requested)
    except ValueError:
        raise InputError(
            f"training.attention: unknown kernel {requested!r}", hint="auto, flash, sdpa or eager"
        ) from None
    if cp > 1:
        if not kernel.runs_ring:
            raise InputError(
                f"training.attention: {kernel} does not run context parallelism (ring attention runs on SDPA)",
                hint="use attention: auto or sdpa with parallel.cp > 1",
            )
        return Attention.SDPA.hf_name, f"cp {cp}: ring attention on SDPA's kernels"
    if kernel is Attention.FLASH:
        if not cuda_available:
            raise InputError(
                "training.attention: flash needs a CUDA GPU and this machine has none",
                hint="use attention: auto or sdpa",
            )
        if not flash_available:
            raise InputError(
                "training.attention: flash needs the flash-attn package, which is not installed",
                hint="pip install 'llmctl[flash]' or use attention: auto",
            )
        return kernel.hf_name, "requested"
    if kernel is Attention.AUTO:
        if cuda_available and flash_available:
            return Attention.FLASH.hf_name, "auto: flash-attn installed and CUDA present"
        missing = "no CUDA" if not cuda_available else "flash-attn not installed"
        return Attention.SDPA.hf_name, f"auto: {missing}, using PyTorch SDPA"
    return kernel.hf_name, "requested"


NO_PATH = {
    Attention.FLASH: ("flash-attention", "use attention: auto"),
    Attention.SDPA: ("SDPA", "use attention: auto or eager"),
}
"""A kernel a model class may lack: (its words, the hint when the plan asked for it by name)."""


def fit_attention(impl: str, requested: str, model_name: str, supports_sdpa: bool, supports_flash: bool) -> str:
    """The kernel a model class can run: `impl` (from `select_attention`), or, where the class has no such path and
    the plan did not ask for that kernel by name, the next one down (flash -> sdpa -> eager). Gemma 2 (attention
    soft-capping) and gpt-oss (attention sinks) declare no SDPA path; transformers refuses to build them with it."""
    supports = {Attention.FLASH: supports_flash, Attention.SDPA: supports_sdpa, Attention.EAGER: True}
    kernel, asked = Attention.from_hf(impl), Attention(requested)
    while not supports[kernel]:
        if asked is kernel:
            words, hint = NO_PATH[kernel]
            raise InputError(f"training.attention: {model_name} has no {words} path in transformers", hint=hint)
        kernel = FALLBACK[kernel]
    return kernel.hf_name


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round the vocabulary up to a multiple (64 gives tensor-core friendly LM-head shapes)."""
    return -(-vocab_size // multiple) * multiple


def torch_dtype(name: str):  # -> torch.dtype
    """The torch dtype of a catalog dtype name (a precision policy's fp32 / bf16 / fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def base_spec(m: ModelSection) -> ModelSpec:
    """The plan's model section as published (preset, config.json or the weights folder's config), overrides
    applied, vocabulary NOT padded: what an exported Hugging Face folder declares."""
    if m.preset:
        base = from_preset(m.preset)
    else:
        base = from_config_ref(m.config) if m.config else from_config_path(m.weights or "")
    from llmctl.spec.rope import merge_overrides

    cfg = merge_overrides(dict(base.hf_config), m.overrides)
    return from_hf_config(cfg, name=base.name, source=base.source)


def model_spec_for(m: ModelSection) -> ModelSpec:
    """The plan's model section as the engine builds it: `base_spec` with the vocabulary padded to
    model.pad_vocab_multiple (the padded rows are never a target: the loss is taken over the real vocabulary)."""
    base = base_spec(m)
    cfg: dict[str, Any] = dict(base.hf_config)
    cfg["vocab_size"] = padded_vocab_size(int(cfg["vocab_size"]), m.pad_vocab_multiple)
    if base.measured is not None:
        # Measured on fake tensors: the padding adds rows to the token embedding (and an untied LM head), nothing
        # else; derived from the base measurement rather than measured again on every rank.
        extra = (cfg["vocab_size"] - base.vocab_size) * base.hidden_size
        m = dict(base.measured)
        m["embedding_params"] = int(m["embedding_params"]) + extra
        m["head_params"] = int(m["head_params"]) + (0 if base.tie_embeddings else extra)
        m["total_params"] = int(m["total_params"]) + extra * (1 if base.tie_embeddings else 2)
        return spec_from_measurement(cfg, m, name=base.name, source=base.source)
    return from_hf_config(cfg, name=base.name, source=base.source)


def build_meta_model(spec: ModelSpec, setup: TrainSetup, attn_impl: str) -> torch.nn.Module:
    """`spec` (model_spec_for: the plan's model, vocabulary padded) on the meta device (no memory, no values,
    use_cache off), trained as `setup`: the attention kernel `attn_impl` or the one `fit_attention` falls back to
    (model.config._attn_implementation says which). `materialize` gives it values after it is sharded. With finetune
    lora, peft's adapters are in it and the base is frozen in the compute dtype (llmctl.engine.lora)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    p = setup.precision
    # pure bf16 builds in bf16; mixed keeps fp32 masters; a LoRA base is frozen: built in the compute dtype
    dtype = torch_dtype(p.compute_dtype if setup.finetune.adapters else p.param_dtype)
    # a preset was checked with the plan file; a config or weights folder is read only now
    problem = model_problem(setup, spec, only=("ring attention",))
    if problem:
        raise SpecError(problem.message, hint="set parallel.cp to 1 for this model")
    cfg = dict(spec.hf_config)
    model_type = cfg.pop("model_type")
    cfg.pop("torch_dtype", None)
    cfg.pop("dtype", None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except Exception as e:  # noqa: BLE001 - transformers' config checks raise several types (StrictDataclassError,
        # TypeError, ValueError, KeyError) for values the user wrote: each is a bad input, not a bug
        raise SpecError(f"model: cannot build a {model_type!r} config: {str(e).splitlines()[0][:200]}") from None
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise SpecError(f"model: transformers has no causal LM class for model_type {model_type!r}") from None
    fitted = fit_attention(
        attn_impl,
        setup.attention,
        cls.__name__,
        bool(getattr(cls, "_supports_sdpa", True)),
        bool(getattr(cls, "_supports_flash_attn", True)),
    )
    if fitted != attn_impl:
        log.info("attention: %s has no %s path in transformers, using %s", cls.__name__, attn_impl, fitted)
        attn_impl = fitted
    config._attn_implementation = attn_impl
    config.use_cache = False  # a KV cache is useless in training and breaks checkpointed backward
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_impl, dtype=dtype)
    model.config.use_cache = False
    if setup.finetune.adapters:  # peft's LoRA layers, the base frozen (llmctl.engine.lora)
        from llmctl.engine.lora import inject

        inject(model, spec, setup.finetune, torch_dtype(p.param_dtype))
    return model


@dataclass(frozen=True)
class Materialized:
    source: str
    """"random init (seed S)" or "weights DIR (N tensors)" or "checkpoint" (values come from a resume)."""
    detail: dict[str, Any]


@dataclass(frozen=True)
class Values:
    """Where a materialized model's values come from."""

    seed: int
    """training.seed: the random init's draws (and a LoRA adapter's, and an NF4 base's without weights)."""
    vocab_size: int
    """The model's real (unpadded) vocabulary: the rows a weights folder holds."""
    weights: Any = None
    """A materialize.WeightFiles of model.weights, or None: random init."""
    resuming: bool = False
    """A checkpoint will overwrite every parameter: no random draws or weight reads."""


def materialize(model: torch.nn.Module, setup: TrainSetup, device: torch.device, values: Values) -> Materialized:
    """Allocate this rank's shard of a meta-built, sharded model on `device` and give it values: random init
    (the model's own init rules, drawn shard by shard: engine/materialize.py), or this rank's slices of local
    Hugging Face weights (`values.weights`: a materialize.WeightFiles). When `values.resuming`, a checkpoint will
    overwrite every parameter: no random draws or weight reads are made (buffers such as RoPE's inv_freq are still
    computed). `setup` says where the shards live (CPU offload) and what the base is (LoRA, QLoRA's NF4)."""
    tied = _tied_pairs(model)
    offload = setup.levers.offload  # FSDP2's CPUOffloadPolicy: the shards live on the host, buffers on the GPU
    nf4: list = []
    if setup.finetune.method == "qlora":  # the block linears allocated in NF4, filled last (engine/qlora.py)
        from llmctl.engine.qlora import placeholders

        nf4 = placeholders(model)
    model.to_empty(device="cpu" if offload else device)
    _retie(model, tied)
    made = _fill(model, setup.finetune.adapters, values)
    if nf4:
        from llmctl.engine.qlora import fill

        n = fill(model, nf4, values.weights, values.seed)
        made = Materialized(made.source + f", {len(nf4)} linears ({n:,} weights) in NF4", made.detail)
    if offload and device.type != "cpu":
        _buffers_to(model, device)
    return made


def _buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Every buffer (RoPE's inv_freq, ...) onto the compute device: under CPU offload only the parameters stay on
    the host (torchtitan's buffer_device)."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None:
                module._buffers[name] = buf.to(device)


def _fill(model: torch.nn.Module, adapters: bool, values: Values) -> Materialized:
    """Values for a materialized model (random init, the weights' slices, or none when resuming)."""
    from llmctl.engine.materialize import init_weights, load_weights, slots

    seed, weights, resuming = values.seed, values.weights, values.resuming
    every = {id(s.param) for s in slots(model)}
    if resuming and not adapters:  # a LoRA checkpoint holds only the adapters: the base is made as for a new run
        init_weights(model, seed, skip=every)
        return Materialized("checkpoint", {})
    if weights is not None:
        init_weights(model, seed, skip=every)
        detail = load_weights(model, weights, values.vocab_size, skip=_not_in_base_files)
        made = Materialized(f"weights {weights.folder} ({detail['tensors']} tensors)", detail)
    else:
        init_weights(model, seed)
        made = Materialized(f"random init (seed {seed})", {})
    if adapters:
        from llmctl.engine.lora import init_adapters

        init_adapters(model, seed)  # peft's init (B = 0: the model starts as its base), or the checkpoint's after
        made = Materialized(
            made.source + ", LoRA adapters " + ("from the checkpoint" if resuming else "new"), made.detail
        )
    return made


def _not_in_base_files(slot: Slot) -> bool:
    """LoRA adapters are not in a base's files; QLoRA's NF4 weights are read whole and quantized
    (llmctl.engine.qlora)."""
    from llmctl.engine.lora import is_adapter
    from llmctl.engine.qlora import is_nf4

    return is_adapter(slot.name) or is_nf4(slot.param)


def _tied_pairs(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, first name) of parameters registered under two names (tied embeddings)."""
    first: dict[int, str] = {}
    pairs = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            pairs.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    return pairs


def _retie(model: torch.nn.Module, pairs: list[tuple[str, str]]) -> None:
    """`to_empty` on a plain (unsharded) model replaces each Parameter object, which unties shared ones; tie them
    again (FSDP2's own `_apply` keeps them tied)."""
    for name, src in pairs:
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        target = model.get_parameter(src)
        if getattr(mod, attr) is not target:
            setattr(mod, attr, target)
