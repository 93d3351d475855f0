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
from llmctl.spec.models import ModelSpec, from_config_path, from_hf_config, from_preset
from llmctl.spec.planfile import Plan
from llmctl.spec.precision import compute_dtype

if TYPE_CHECKING:
    import torch

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


def select_attention(requested: str, cuda_available: bool, flash_available: bool) -> tuple[str, str]:
    """Plan attention -> (transformers attn_implementation, why). `flash` where it cannot run fails fast."""
    if requested == "flash":
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
        return "flash_attention_2", "requested"
    if requested == "auto":
        if cuda_available and flash_available:
            return "flash_attention_2", "auto: flash-attn installed and CUDA present"
        missing = "no CUDA" if not cuda_available else "flash-attn not installed"
        return "sdpa", f"auto: {missing}, using PyTorch SDPA"
    if requested in ("sdpa", "eager"):
        return requested, "requested"
    raise InputError(f"training.attention: unknown kernel {requested!r}", hint="auto, flash, sdpa or eager")


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round the vocabulary up to a multiple (64 gives tensor-core friendly LM-head shapes)."""
    return -(-vocab_size // multiple) * multiple


def param_dtype_name(precision: str) -> str:
    """Dtype the matmuls run in, for the catalog peak (fp32 -> TF32 peak where the GPU has it)."""
    return compute_dtype(precision)


def base_spec(plan: Plan) -> ModelSpec:
    """The plan's model as published (preset, config.json or the weights folder's config), overrides applied,
    vocabulary NOT padded: what an exported Hugging Face folder declares."""
    m = plan.model
    if m.preset:
        base = from_preset(m.preset)
    else:
        base = from_config_path(m.config or m.weights or "")
    cfg: dict[str, Any] = dict(base.hf_config)
    cfg.update(m.overrides)
    return from_hf_config(cfg, name=base.name, source=base.source)


def model_spec_for(plan: Plan) -> ModelSpec:
    """The plan's model as the engine builds it: `base_spec` with the vocabulary padded to
    model.pad_vocab_multiple (the padded rows are never a target: the loss is taken over the real vocabulary)."""
    base = base_spec(plan)
    cfg: dict[str, Any] = dict(base.hf_config)
    cfg["vocab_size"] = padded_vocab_size(int(cfg["vocab_size"]), plan.model.pad_vocab_multiple)
    return from_hf_config(cfg, name=base.name, source=base.source)


def build_model(plan: Plan, attn_impl: str, device: torch.device) -> torch.nn.Module:
    """Random init from a preset/config, or local weights; vocabulary padded; use_cache off (training)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    m = plan.model
    dtype = torch.bfloat16 if plan.training.precision == "bf16" else torch.float32
    if m.weights:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                m.weights, attn_implementation=attn_impl, dtype=dtype, local_files_only=True, **m.overrides
            )
        except (OSError, ValueError) as e:
            raise SpecError(f"model.weights: cannot load {m.weights!r}: {str(e).splitlines()[0]}") from None
        vocab = model.get_input_embeddings().weight.shape[0]
        padded = padded_vocab_size(vocab, m.pad_vocab_multiple)
        if padded != vocab:
            model.resize_token_embeddings(padded, mean_resizing=False)
    else:
        spec = model_spec_for(plan)
        cfg = dict(spec.hf_config)
        model_type = cfg.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **cfg)
        except (TypeError, ValueError) as e:
            raise SpecError(f"model.overrides: {e}") from None
        config._attn_implementation = attn_impl
        # Seed the init identically on every rank: FSDP2 shards a model every rank built the same way.
        torch.manual_seed(plan.training.seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_impl, dtype=dtype)
    model.config.use_cache = False  # a KV cache is useless in training and breaks checkpointed backward
    return model.to(device)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ModuleList of transformer blocks (Llama-style `model.layers`, GPT-2 `transformer.h`)."""
    import torch

    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    raise SpecError(
        f"{type(model).__name__}: cannot find the decoder layers to shard",
        hint="supported: Llama-style (model.layers) and GPT-2 (transformer.h)",
    )
