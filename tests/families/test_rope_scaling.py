"""RoPE scaling passes through to the model the engine builds (issue 27: long context): Llama 3.1's `llama3` and
Qwen's `yarn`, written in a plan's model.overrides, in a config.json as `rope_scaling` (transformers 4's key, the
hub's files) or as `rope_parameters` (transformers 5's key), through a preset, and through `llmctl export`.

The rotary tables are checked against the scalings' own definitions, computed here by hand: llama3 (Meta's
`apply_scaling` in llama-models, the Llama 3.1 release) divides the low-frequency components by `factor`, keeps the
high-frequency ones and blends the band between; YaRN (Peng et al. 2023, arXiv:2309.00071, sec. 3.2-3.3)
interpolates the dimensions that turn fewer than beta_slow times over the original context, keeps those that turn
more than beta_fast times, ramps linearly between, and scales attention by 0.1 ln(s) + 1. A model that drops the
scaling has the unscaled table (and attention factor 1) and fails every check.

transformers 5 reads `rope_scaling` into `config.rope_parameters` (with `rope_theta` merged in) and writes only
`rope_parameters` to config.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from llmctl.families import REGISTRY
from llmctl.spec.planfile import Plan, load_plan

LLAMA3 = {  # meta-llama/Llama-3.1-8B config.json
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}  # Qwen's model cards
# A one-layer Llama: hidden 64, 4 heads of 16 (8 rotary frequencies), Llama 3.1's theta and context
SHRINK = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
SHRINK |= {"num_key_value_heads": 2}
LONG = {"max_position_embeddings": 131072, "rope_theta": 500000.0}
HEAD_DIM = 16


# ---------------------------------------------------------------------------------------------- the definitions


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """RoPE (Su et al. 2021): theta^(-2i/d), i = 0 .. d/2 - 1."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def llama3_inv_freq(theta: float, dim: int, s: dict[str, Any]) -> torch.Tensor:
    """Meta's apply_scaling (llama-models, Llama 3.1): wavelengths longer than original/low_freq_factor are divided by
    factor, shorter than original/high_freq_factor kept, and the band between blended by a smooth factor."""
    inv = default_inv_freq(theta, dim)
    orig, factor, lo, hi = (
        s["original_max_position_embeddings"],
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
    )
    out = []
    for f in inv.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < orig / hi:
            out.append(f)
        elif wavelen > orig / lo:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def yarn_inv_freq(
    theta: float, dim: int, s: dict[str, Any], beta_fast: float = 32, beta_slow: float = 1
) -> torch.Tensor:
    """YaRN's "NTK-by-parts": dimension d turns orig / (2 pi / inv_d) times over the original context; at most
    beta_slow turns: interpolated (inv / factor); at least beta_fast: kept; a linear ramp between, over the
    dimensions rounded outward (floor of the low bound, ceil of the high one, as the reference code does)."""
    inv = default_inv_freq(theta, dim)
    orig, factor = s["original_max_position_embeddings"], s["factor"]

    def dim_of(turns: float) -> float:  # the (fractional) index i at which orig / wavelen_i == turns
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


# ---------------------------------------------------------------------------------------------- building


def write_plan(folder: Path, model: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    plan = {
        "name": "rope-scaling",
        "model": model,
        "data": {"kind": "synthetic"},
        "hardware": {"nodes": 1, "nproc_per_node": 1},
        "training": {"precision": "fp32", "micro_batch_size": 1, "seq_len": 64, "max_steps": 1, "attention": "sdpa"},
        "logging": {"dir": str(folder / "logs")},
    }
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def write_config(folder: Path, cfg: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder / "config.json")


def meta_model(plan: Plan) -> torch.nn.Module:
    from llmctl.engine.model import build_meta_model, model_spec_for

    return build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")


def cpu_model(plan: Plan) -> torch.nn.Module:
    """The engine's model with values, in this process (a world of one): rotary tables recomputed by the model's
    own init rules, as every rank does after sharding."""
    from llmctl.engine.model import Values, base_spec, materialize

    model = meta_model(plan)
    materialize(model, plan.setup, torch.device("cpu"), Values(plan.training.seed, base_spec(plan.model).vocab_size))
    return model


def rotary(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.rotary_emb


def rope_of(model: torch.nn.Module) -> dict[str, Any]:
    return dict(model.config.rope_parameters)


def plan_at(tmp_path: Path, name: str, model: dict[str, Any]) -> Plan:
    return load_plan(write_plan(tmp_path / name, model))


# ---------------------------------------------------------------------------------------------- the checks


def test_llama3_scaling_in_plan_overrides_reaches_the_rotary_tables(tmp_path: Path) -> None:
    scaled = plan_at(tmp_path, "s", {"preset": "llama-tiny", "overrides": {**SHRINK, **LONG, "rope_scaling": LLAMA3}})
    plain = plan_at(tmp_path, "p", {"preset": "llama-tiny", "overrides": {**SHRINK, **LONG}})
    meta = meta_model(scaled)
    assert rope_of(meta) == {**LLAMA3, "rope_theta": 500000.0}  # unchanged, theta merged in
    assert rotary(meta).rope_type == "llama3" and rotary(meta).attention_scaling == 1.0

    inv = rotary(cpu_model(scaled)).inv_freq.double()
    base = rotary(cpu_model(plain)).inv_freq.double()
    torch.testing.assert_close(base, default_inv_freq(500000.0, HEAD_DIM).to(base.dtype), rtol=1e-6, atol=0)
    torch.testing.assert_close(inv, llama3_inv_freq(500000.0, HEAD_DIM, LLAMA3), rtol=1e-6, atol=0)
    # what the definition does to theta 500000, 8 frequencies: wavelengths 6 .. 864 tokens (< 8192/4) kept,
    # 4458 blended, 23k .. 610k (> 8192) divided by 8
    ratio = (base / inv).tolist()
    assert ratio[:4] == pytest.approx([1.0] * 4) and ratio[5:] == pytest.approx([8.0] * 3)
    assert 1.0 < ratio[4] < 8.0


def test_yarn_scaling_in_a_qwen3_config_file(tmp_path: Path) -> None:
    """Qwen's recipe for 128k: yarn x4 over 32k, added to the config.json (the hub's `rope_scaling` key)."""
    qwen = {**REGISTRY["qwen3"].tiny, "num_hidden_layers": 1, "max_position_embeddings": 131072, "rope_theta": 1e6}
    scaled = plan_at(tmp_path, "s", {"config": write_config(tmp_path / "cfg-s", {**qwen, "rope_scaling": YARN})})
    plain = plan_at(tmp_path, "p", {"config": write_config(tmp_path / "cfg-p", qwen)})
    meta = meta_model(scaled)
    assert rope_of(meta) == {**YARN, "rope_theta": 1e6}
    # YaRN's attention temperature: sqrt(1/t) = 0.1 ln(s) + 1 (eq. 22 of the paper), 1.1386 for s = 4
    assert rotary(meta).attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rotary(meta_model(plain)).attention_scaling == 1.0

    dim = qwen["head_dim"]
    inv = rotary(cpu_model(scaled)).inv_freq.double()
    base = rotary(cpu_model(plain)).inv_freq.double()
    torch.testing.assert_close(inv, yarn_inv_freq(1e6, dim, YARN), rtol=1e-6, atol=0)
    ratio = (base / inv).tolist()
    # theta 1e6, 8 frequencies: 32 turns in 32k tokens fall at dimension 2.95 and one turn at 4.96, so dims 0-2 are
    # kept (the ramp starts at floor 2), 5-7 divided by 4 (it ends at ceil 5), and 3-4 ramp between
    assert ratio[:3] == pytest.approx([1.0] * 3) and ratio[5:] == pytest.approx([4.0] * 3)
    assert ratio[3:5] == pytest.approx([1 / (1 - 1 / 3 + 1 / 12), 1 / (1 - 2 / 3 + 2 / 12)])


def test_rope_parameters_spelling_gives_the_same_model(tmp_path: Path) -> None:
    """transformers 5's key in a config.json (what `save_pretrained` and `llmctl export` write) builds the same
    tables as the hub's `rope_scaling` with a top-level `rope_theta`."""
    llama = {"model_type": "llama", **SHRINK, "vocab_size": 320, "max_position_embeddings": 131072}
    new = write_config(tmp_path / "new", {**llama, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}})
    old = write_config(tmp_path / "old", {**llama, "rope_theta": 500000.0, "rope_scaling": LLAMA3})
    models = [cpu_model(plan_at(tmp_path, name, {"config": path})) for name, path in (("n", new), ("o", old))]
    assert rope_of(models[0]) == rope_of(models[1]) == {**LLAMA3, "rope_theta": 500000.0}
    for m in models:
        torch.testing.assert_close(rotary(m).inv_freq.double(), llama3_inv_freq(500000.0, HEAD_DIM, LLAMA3))


def test_a_preset_rope_passes_through_unchanged(tmp_path: Path) -> None:
    """Whatever RoPE a preset declares is what the engine builds (model.overrides shrink the shapes only)."""
    from llmctl.spec.models import preset_entry

    entry = preset_entry("llama-3.1-8b")["config"]
    meta = meta_model(plan_at(tmp_path, "p", {"preset": "llama-3.1-8b", "overrides": SHRINK}))
    want = dict(entry.get("rope_scaling") or {"rope_type": "default"})
    assert rope_of(meta) == {**want, "rope_theta": entry["rope_theta"]}


def test_the_llama_3_1_preset_carries_its_published_rope_scaling() -> None:
    from llmctl.spec.models import preset_entry

    assert preset_entry("llama-3.1-8b")["config"].get("rope_scaling") == LLAMA3


def test_a_rope_scaling_override_keeps_the_theta_of_a_transformers_5_config(tmp_path: Path) -> None:
    llama = {"model_type": "llama", **SHRINK, "vocab_size": 320, "max_position_embeddings": 131072}
    cfg = write_config(tmp_path / "c", {**llama, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    meta = meta_model(plan_at(tmp_path, "p", {"config": cfg, "overrides": {"rope_scaling": LLAMA3}}))
    assert rope_of(meta) == {**LLAMA3, "rope_theta": 500000.0}


def test_a_rope_parameters_override_replaces_a_configs_rope_scaling(tmp_path: Path) -> None:
    llama = {"model_type": "llama", **SHRINK, "vocab_size": 320, **LONG, "rope_scaling": LLAMA3}
    cfg = write_config(tmp_path / "c", llama)
    over = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    meta = meta_model(plan_at(tmp_path, "p", {"config": cfg, "overrides": over}))
    assert rope_of(meta) == {"rope_type": "default", "rope_theta": 500000.0}


def checkpoint_of(plan_path: Path) -> Path:
    """A step folder in the engine's layout (DCP {"model": state_dict} + plan.yaml) of the plan's model, built and
    initialised as the engine does in a world of one."""
    import shutil

    import torch.distributed.checkpoint as dcp

    model = cpu_model(load_plan(plan_path))
    step = plan_path.parent / "ckpt" / "step_00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    shutil.copy(plan_path, step / "plan.yaml")
    from llmctl.engine.checkpoint_files import write_marker

    write_marker(step)  # the export reads only folders llmctl wrote
    return step


def test_export_keeps_the_scaling_in_config_json(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    model = {"preset": "llama-tiny", "overrides": {**SHRINK, **LONG, "vocab_size": 300, "rope_scaling": LLAMA3}}
    step = checkpoint_of(write_plan(tmp_path / "run", model))
    out = tmp_path / "hf"
    result = CliRunner().invoke(app, ["export", str(step), "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    assert rope_of(loaded) == {**LLAMA3, "rope_theta": 500000.0}
    torch.testing.assert_close(rotary(loaded).inv_freq.double(), llama3_inv_freq(500000.0, HEAD_DIM, LLAMA3))


def test_export_of_a_fine_tune_with_a_rope_scaling_override_keeps_theta(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    from typer.testing import CliRunner

    from llmctl.cli.main import app

    base = AutoConfig.for_model("llama", **SHRINK, vocab_size=300, **LONG)
    AutoModelForCausalLM.from_config(base).save_pretrained(tmp_path / "base")
    model = {"weights": str(tmp_path / "base"), "overrides": {"rope_scaling": LLAMA3}}
    step = checkpoint_of(write_plan(tmp_path / "run", model))
    result = CliRunner().invoke(app, ["export", str(step), "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["rope_parameters"] == {**LLAMA3, "rope_theta": 500000.0}
