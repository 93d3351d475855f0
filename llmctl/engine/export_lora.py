"""`llmctl export` of a LoRA checkpoint: the adapters as a peft folder, and with `--merge` the merged model too.

A LoRA checkpoint holds only the adapters (and their optimizer states) and names its frozen base
(llmctl.engine.checkpoint, trainer.pt's `frozen_base`). The export:
- checks the plan's base is the one the adapters were trained on (llmctl.engine.lora.check_base);
- writes what `peft.PeftModel.from_pretrained(base, OUT)` reads: adapter_config.json (LoraConfig of the plan's
  rank, alpha, dropout and targets, base_model_name_or_path = the weights folder) and adapter_model.safetensors,
  whose names are peft's (`base_model.model.<module>.lora_A.weight`: the adapter name dropped, as
  peft.utils.get_peft_model_state_dict saves them);
- with `merge`, also OUT/merged: the base loaded by transformers from model.weights, the adapters applied by peft
  and folded in (`merge_and_unload`: W + alpha/r B A), saved with save_pretrained. A random-init base has no
  folder to merge into: refused with one line.
Everything is written beside OUT and renamed into place (llmctl.engine.export._publish), as the full export.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.engine.export import (
    DTYPES,
    ExportRequest,
    _dcp_load,
    _read_metadata,
    check_out,
    default_dtype,
    fresh_temp,
    import_transformers_quietly,
    peak_rss_bytes,
    publish_durably,
    raise_disk_full,
    resolve_checkpoint,
    resolve_plan,
)
from llmctl.engine.lora import ADAPTER, base_identity, check_base, is_adapter, lora_config
from llmctl.errors import InputError
from llmctl.spec.planfile import DataSection, ModelSection

ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED = "merged"


@dataclass(frozen=True)
class AdapterExport:
    out: Path
    step_dir: Path
    step: int | None
    plan_source: Path
    tensors: int
    total_bytes: int
    dtype: str
    rank: int
    alpha: float
    base: str
    merged: Path | None
    seconds: float
    peak_rss_bytes: int


def peft_name(fqn: str) -> str:
    """The engine's parameter name -> peft's saved name: base_model.model. in front, the adapter name dropped."""
    return "base_model.model." + fqn.replace(f".{ADAPTER}.", ".")


def export_adapter(req: ExportRequest, merge: bool = False) -> AdapterExport:
    start = time.perf_counter()
    step_dir, step = resolve_checkpoint(req.checkpoint)
    plan, plan_source = resolve_plan(step_dir, req.plan)
    check_out(req.out, req.force, step_dir)
    import torch

    import_transformers_quietly()
    from llmctl.engine.checkpoint_files import load_plain
    from llmctl.engine.model import model_spec_for

    trainer = load_plain(step_dir / "trainer.pt") if (step_dir / "trainer.pt").is_file() else {}  # plain data only
    # a weights folder is known by its files: its config is read only for the adapters' config below
    current = base_identity(plan.model, plan.training.seed, None if plan.model.weights else model_spec_for(plan.model))
    check_base(trainer.get("frozen_base"), current, f"checkpoint {step_dir}")
    if merge and not plan.model.weights:
        raise InputError(
            f"--merge needs the base's weights folder, and {plan_source} trained adapters on a random init",
            hint="export the adapters alone (without --merge)",
        )
    dtype_name = req.dtype or "fp32"  # the adapters train in fp32 (the parameter dtype of every precision)
    out_dtype = getattr(torch, DTYPES[dtype_name])
    metadata = _read_metadata(step_dir)
    want: dict[str, torch.Tensor] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and is_adapter(key):
            want[key.removeprefix("model.")] = torch.empty(tuple(meta.size), dtype=torch.float32)
    if not want:
        raise InputError(f"{step_dir}: no LoRA adapter tensors in the checkpoint")
    _dcp_load(want, step_dir)
    tensors = {peft_name(k): v.to(out_dtype).contiguous() for k, v in sorted(want.items())}

    from safetensors.torch import save_file

    out, tmp = fresh_temp(req.out)
    try:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = lora_config(model_spec_for(plan.model), plan.setup.finetune)
        config.inference_mode = True  # as peft saves a trained adapter
        config.base_model_name_or_path = str(Path(plan.model.weights).resolve()) if plan.model.weights else None
        config.save_pretrained(str(tmp))
        _note_base(tmp, current)
        merged = None
        if merge:
            dtype = req.dtype or default_dtype(plan.setup)
            merged = _merge(plan.model, plan.data, tmp, tmp / MERGED, dtype, req.max_shard_bytes)
        publish_durably(tmp, out, req.force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_disk_full(e, req.out)
        raise
    ft = plan.setup.finetune
    return AdapterExport(
        out=req.out,
        step_dir=step_dir,
        step=step,
        plan_source=plan_source,
        tensors=len(tensors),
        total_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
        dtype=dtype_name,
        rank=ft.rank,
        alpha=ft.alpha,
        base=current["base"],
        merged=None if merged is None else req.out / MERGED,
        seconds=time.perf_counter() - start,
        peak_rss_bytes=peak_rss_bytes(),
    )


def _note_base(folder: Path, identity: dict[str, str]) -> None:
    """llmctl's record of the base beside peft's files (peft ignores unknown files)."""
    (folder / "llmctl_base.json").write_text(json.dumps(identity, indent=2) + "\n")


def _merge(
    m: ModelSection, data: DataSection, adapter: Path, dest: Path, dtype_name: str, max_shard_bytes: int
) -> Path:
    """The base from model.weights with the adapters folded in, saved by transformers into `dest` with the tokenizer
    and chat template the run trained with (llmctl.engine.export_tokenizer), else the weights folder's."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the summary lines say what was written
    weights = Path(m.weights or "")
    base: Any = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32, local_files_only=True)
    model = PeftModel.from_pretrained(base, str(adapter), is_trainable=False).merge_and_unload()
    model = model.to(getattr(torch, DTYPES[dtype_name]))
    model.save_pretrained(dest, max_shard_size=max_shard_bytes)
    from llmctl.engine.export_tokenizer import run_tokenizer, write_tokenizer

    if write_tokenizer(run_tokenizer(data, m.weights), dest):
        return dest  # the run's tokenizer whole: no file of another one mixed in
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (weights / name).is_file():
            shutil.copyfile(weights / name, dest / name)
    return dest


def summary_lines(r: AdapterExport) -> list[str]:
    from llmctl.units import fmt_bytes

    step = f" (step {r.step})" if r.step is not None else ""
    lines = [
        f"exported the LoRA adapters of {r.step_dir}{step} -> {r.out}",
        f"  {r.tensors} tensors, {fmt_bytes(r.total_bytes)} {r.dtype}; rank {r.rank}, alpha {r.alpha:g}; "
        f"base: {r.base}",
        f"  plan: {r.plan_source}; {r.seconds:.1f} s, peak RSS {fmt_bytes(r.peak_rss_bytes)}",
        f"  load it: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), {str(r.out)!r})",
    ]
    if r.merged is not None:
        lines.append(f"  merged model: AutoModelForCausalLM.from_pretrained({str(r.merged)!r})")
    return lines
