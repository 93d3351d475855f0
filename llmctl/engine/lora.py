"""LoRA in the engine: peft's adapters injected into the transformers model before AC, compile and FSDP2.

- `inject`: peft's `inject_adapter_in_model` on the meta-built model (module names stay those of transformers, so
  activation checkpointing, FSDP2's per-layer units and the loss find their modules as in full training). Each
  targeted linear becomes a peft LoraLayer: `base_layer` (the frozen linear) plus `lora_A.default` (r x in) and
  `lora_B.default` (out x r). The base is built in the compute dtype and frozen; the adapters are kept in the
  parameter dtype (fp32 masters under bf16-mixed: FSDP2 casts them for compute and reduces their gradients in
  fp32, as for full training's weights). FSDP2 checks that the *trainable* parameters of a unit share one dtype
  (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `_init_mp_dtypes`), so frozen bf16 and trainable fp32
  parameters sit in one unit.
- `init_adapters`: peft's own init (`LoraLayer.reset_lora_parameters` with init_lora_weights=True): A
  kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zeros, so the model starts as the base.
  Drawn block by block like every other weight (llmctl.engine.materialize.draw_rows): the same values on any world
  size.
- `base_identity`: what the frozen base is (its weights folder, or the config and seed of a random init) and a
  fingerprint, stored in every checkpoint: a resume or an export on another base is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.errors import InputError, SpecError
from llmctl.spec.finetune import Finetune, targets_for

if TYPE_CHECKING:
    import torch

    from llmctl.spec.models import ModelSpec
    from llmctl.spec.planfile import ModelSection

ADAPTER = "default"
"""peft's adapter name (the one `PeftModel.from_pretrained` loads)."""


def is_adapter(name: str) -> bool:
    """A parameter of a LoRA adapter (peft's lora_A / lora_B modules), by its dotted name."""
    return ".lora_A." in name or ".lora_B." in name


def check_installed(ft: Finetune) -> None:
    """One line before anything is built: peft for lora and qlora, torchao's NF4 for qlora (engine/qlora.py; it
    runs on a CPU rank too)."""
    if not ft.adapters:
        return
    if ft.method == "qlora":
        from llmctl.engine.qlora import check_installed as check_nf4

        check_nf4()
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise InputError(
            f"finetune.method {ft.method} needs the peft package, which is not installed",
            hint="pip install 'llmctl[lora]'",
        )


def lora_config(spec: ModelSpec, ft: Finetune) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=ft.rank,
        lora_alpha=ft.alpha,
        lora_dropout=ft.dropout,
        target_modules=list(targets_for(spec, ft)),
        bias="none",
        fan_in_fan_out=spec.features.conv1d,  # GPT-2's Conv1D stores (in, out) weights (peft would set it and warn)
        task_type="CAUSAL_LM",
    )


def inject(model: torch.nn.Module, spec: ModelSpec, ft: Finetune, adapter_dtype: torch.dtype) -> int:
    """Adapters into `model` (on the meta device) in place; everything else frozen. Returns the trainable
    parameters (the adapters')."""
    import torch
    from peft import inject_adapter_in_model

    config = lora_config(spec, ft)
    try:
        with torch.device("meta"):
            inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise SpecError(f"finetune.lora_targets: {str(e).splitlines()[0][:200]}") from None
    trainable = 0
    for name, p in model.named_parameters():
        train = is_adapter(name)
        p.requires_grad_(train)
        if train:
            trainable += p.numel()
    for module in model.modules():
        for attr in ("lora_A", "lora_B"):
            sub = getattr(module, attr, None)
            if isinstance(sub, torch.nn.ModuleDict):
                sub.to(adapter_dtype)
    return trainable


def adapter_slots(model: torch.nn.Module) -> list[Any]:
    """The materialize slots of the adapters' parameters."""
    from llmctl.engine.materialize import slots

    return [s for s in slots(model) if is_adapter(s.name)]


def init_adapters(model: torch.nn.Module, seed: int) -> int:
    """peft's init of every adapter on this rank's shard (module doc); returns how many tensors were set."""
    import torch

    from llmctl.engine.materialize import draw_rows

    n = 0
    with torch.no_grad():
        for s in adapter_slots(model):
            if ".lora_B." in s.name:
                s.local.zero_()
            else:  # lora_A: (r, in), kaiming_uniform_(a=sqrt(5)) -> bound = 1 / sqrt(fan_in)
                bound = 1.0 / math.sqrt(s.global_shape[1])
                draw_rows(s, seed, "uniform", -bound, bound)
            n += 1
    return n


def trainable_params(model: torch.nn.Module) -> int:
    """Parameters that train (the whole model's, not this rank's shard)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# --- the frozen base's identity -------------------------------------------------------------------------------------
SAMPLES = 8
SAMPLE_BYTES = 1 << 16


def fingerprint_folder(folder: Path) -> str:
    """A fingerprint of a weights folder's safetensors files, read in well under a second at any size: each file's
    name, size and header (every tensor's name, dtype, shape and offsets), and 8 samples of 64 KiB spread over its
    data, plus config.json. A changed value outside the samples goes unseen (a full hash of 140 GB would take
    minutes at every start); a different model, size, dtype or a re-saved file does not."""
    h = hashlib.sha256()
    cfg = folder / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + f.read(min(n, size)))
            start = 8 + n
            span = max(0, size - start - SAMPLE_BYTES)
            for k in range(SAMPLES):
                f.seek(start + span * k // max(1, SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]


def base_identity(m: ModelSection, seed: int, spec: ModelSpec | None) -> dict[str, str]:
    """What the adapters were trained on: {"base": words, "fingerprint": hex}. A weights folder by its fingerprint;
    a random init by the model's config as the engine builds it (`spec`: llmctl.engine.model.model_spec_for(m), None
    only with a weights folder) and the seed (the same config and seed give the same base)."""
    if m.weights:
        folder = Path(m.weights).resolve()
        return {"base": f"weights {folder}", "fingerprint": fingerprint_folder(folder)}
    if spec is None:
        raise ValueError("a random init's identity needs the model spec")
    cfg = json.dumps(spec.hf_config, sort_keys=True, default=str)
    digest = hashlib.sha256(f"{cfg}\0seed {seed}".encode()).hexdigest()[:32]
    what = m.preset or m.config
    return {"base": f"random init of {what} (seed {seed})", "fingerprint": digest}


def check_base(saved: dict[str, str] | None, current: dict[str, str], where: str) -> None:
    """Refuse adapters trained on another base (one line, exit 2)."""
    if saved is None:
        raise SpecError(f"{where} holds no frozen base's identity: it was not saved by a LoRA run")
    if saved.get("fingerprint") != current["fingerprint"]:
        raise SpecError(
            f"{where} holds adapters trained on {saved.get('base')} (fingerprint {saved.get('fingerprint')}), "
            f"not on this plan's base, {current['base']} (fingerprint {current['fingerprint']})",
            hint="point model.weights (or model.preset and training.seed) at the base the adapters were trained on",
        )
