"""The planner's choice as the engine's plan file (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmctl.errors import InputError, SpecError
from llmctl.plan import comm as cm
from llmctl.plan.timing import Candidate
from llmctl.spec import planfile as pf
from llmctl.units import duration

if TYPE_CHECKING:
    from llmctl.plan.planner import PlanResult
    from llmctl.spec.models import ModelSpec


def predicted_section(c: Candidate, network: cm.Network | None = None) -> dict[str, Any]:
    """The plan's `predicted:` section for a candidate (rounded as written); with the network, the bus bandwidths the
    prediction assumed (the launch preflight compares with them)."""
    p = c.predicted
    out: dict[str, Any] = {
        "tokens_per_s": round(p.tokens_per_s, 1),
        "tokens_per_s_per_gpu": round(p.tokens_per_s_per_gpu, 1),
        "mfu": round(p.mfu, 4),
        "mfu_palm": round(p.mfu_palm, 4),
        "step_time_s": round(p.step_time_s, 4),
        "memory_per_gpu_bytes": p.memory_per_gpu_bytes,
    }
    if network is not None:
        out["intra_node_busbw_gbytes_s"] = round(network.intra_gbytes_s, 3)
        inter = network.inter_node_gbytes_s
        out["inter_node_busbw_gbytes_s"] = round(inter, 3) if c.setup.nodes > 1 and inter is not None else None
    return out


DEFAULT_CHECKPOINT_MINUTES = 30.0
"""How often a planned run checkpoints by default, in minutes of training: what a failure loses at most (half of it on
average). torchtitan's and Megatron-LM's examples save every few hundred steps, which at their step times is 10-60
minutes; a SLURM time limit or preemption is covered apart from this (SIGUSR1 saves a checkpoint first)."""
DEFAULT_RUNS_DIR = "runs"


@dataclass(frozen=True)
class RunOptions:
    """What makes a plan a run and not only a prediction: its data (a `data:` section, llmctl.data.check.plan_data)
    and its folder (checkpoints under <run_dir>/checkpoints, logs and metrics in <run_dir>)."""

    data: dict[str, Any] | None = None
    """None: synthetic tokens."""
    run_dir: str | None = None
    """None: runs/<plan name>."""
    checkpoint_minutes: float = DEFAULT_CHECKPOINT_MINUTES
    keep_last: int = 2


def checkpoint_interval_steps(step_time_s: float, minutes: float) -> int:
    """Optimizer steps between checkpoints for about `minutes` of training at the planned step time (at least 1)."""
    if step_time_s <= 0:
        return 1
    return max(1, math.ceil(minutes * 60 / step_time_s))


def _model_name(name: str, source: str) -> str:
    """A preset's name as it is (llama-3.1-8b keeps its dots); a config's folder name (.../Qwen3-8B/config.json)."""
    if source == "preset":
        return name
    p = Path(name)
    return p.parent.name if p.name == "config.json" else p.name


def _total_steps(training: dict[str, Any], tokens_per_step: int) -> int:
    if training["max_steps"]:
        return int(training["max_steps"])
    return -(-int(training["token_budget"]) // tokens_per_step)


def writes_plan(spec: ModelSpec) -> bool:
    """Whether `llmctl plan` writes a plan file for a model of this source: a preset or a config.json, which the engine
    builds the architecture from on every rank (--params gives none)."""
    return spec.source in ("preset", "config")


def to_plan(result: PlanResult, name: str | None = None, run: RunOptions | None = None) -> pf.Plan | None:
    """The chosen candidate as the engine's plan file (None for --params: the engine needs an architecture).
    Validated like a plan file read from disk: a request the engine could not run (a token budget of more than
    planfile.MAX_STEPS steps, a sequence longer than a GPT-2's positions) is one SpecError line, not a plan.
    With `run`: its data, and checkpoints and logs in its run folder (without: synthetic data, no checkpoints)."""
    if not writes_plan(result.request.spec):
        return None
    req, c = result.request, result.chosen
    spec, s = req.spec, c.setup
    model = {"preset": spec.name} if spec.source == "preset" else {"config": spec.name}
    sections = pf.setup_sections(s)
    data: dict[str, Any] = {
        "name": name
        or f"{_model_name(spec.name, spec.source)}-{s.strategy}-{s.nodes}x{s.gpus_per_node}"
        + "".join(f"-{t}" for t in s.dims.tags()),
        "model": model,
        "hardware": {"gpu": req.gpu.name, **sections["hardware"]},
        "parallel": sections["parallel"],
        "training": {
            **sections["training"],
            "token_budget": req.token_budget,
            "max_steps": None if req.token_budget else 1000,
        },
        "optimizer": sections["optimizer"],
        "finetune": sections["finetune"],  # plan_to_yaml leaves out full training's
        "predicted": predicted_section(c, req.network),
    }
    if run is not None:
        folder = run.run_dir or str(Path(DEFAULT_RUNS_DIR) / data["name"])
        data["data"] = run.data or {"kind": "synthetic"}
        data["checkpoint"] = {
            "dir": str(Path(folder) / "checkpoints"),
            # At most the run's length: a run shorter than the interval saves at its end (and on SIGUSR1).
            "interval_steps": min(
                checkpoint_interval_steps(c.predicted.step_time_s, run.checkpoint_minutes),
                _total_steps(data["training"], s.tokens_per_step),
            ),
            "keep_last": run.keep_last,
        }
        data["logging"] = {"dir": folder}
    try:
        return pf.Plan.model_validate(data)
    except ValidationError as e:
        raise SpecError(pf.error_line(e, "the plan to write")) from None


def train_from_local_weights(plan_obj: pf.Plan | None) -> pf.Plan | None:
    """A model folder that holds weights (`*.safetensors` next to its config.json) is fine-tuned from them: the plan
    says model.weights (each rank reads its slices at start), not model.config (random init)."""
    if plan_obj is None or not plan_obj.model.config:
        return plan_obj
    cfg = Path(plan_obj.model.config)
    folder = cfg if cfg.is_dir() else cfg.parent
    if any(folder.glob("*.safetensors")):
        model = {"weights": str(folder), "pad_vocab_multiple": plan_obj.model.pad_vocab_multiple}
        return pf.plan_from_dict({**plan_obj.model_dump(mode="json"), "model": model}, "the plan to write")
    return plan_obj


def run_plan(
    result: PlanResult,
    data: list[str] | None = None,
    synthetic: bool = False,
    tokenizer: str | None = None,
    run_dir: str | None = None,
    checkpoint_minutes: float = DEFAULT_CHECKPOINT_MINUTES,
) -> tuple[pf.Plan | None, list[str]]:
    """`llmctl plan`'s plan file as a run: its data (checked now: llmctl.data.check.plan_data), checkpoints and logs
    in its run folder, fine-tuning from a local weights folder; with the lines that say so. None (and no lines) for
    --params, which gives the engine no architecture."""
    if not writes_plan(result.request.spec):
        return None, []
    if run_dir is not None and Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise InputError(f"--run-dir {run_dir}: is a file, not a folder (checkpoints and logs go in it)")
    run = RunOptions(run_dir=run_dir, checkpoint_minutes=checkpoint_minutes)
    plan_obj = train_from_local_weights(to_plan(result, run=run))
    assert plan_obj is not None  # a preset or config always gives a plan
    notes = []
    if data:
        from llmctl.data.check import plan_data  # numpy, and transformers for a tokenizer folder: only when asked

        section, line = plan_data(data, result.request.spec.vocab_size, tokenizer, plan_obj.model.weights)
        plan_obj = pf.plan_from_dict({**plan_obj.model_dump(mode="json"), "data": section}, "the plan to write")
        notes.append(f"data: {line}")
    ck = plan_obj.checkpoint
    step_s = result.chosen.predicted.step_time_s
    if ck.interval_steps >= plan_obj.total_steps:
        when = f"at the end of its {plan_obj.total_steps:,} steps (~{duration(plan_obj.total_steps * step_s)} planned)"
    else:
        when = f"every {ck.interval_steps:,} steps (~{duration(ck.interval_steps * step_s)} at {step_s:.3g} s per step)"
    notes.append(f"run folder: {plan_obj.logging.dir}; checkpoints {when} and on SIGUSR1, the last {ck.keep_last} kept")
    if data is None:
        notes.append(
            "data: synthetic (random tokens), as asked; `llmctl launch` runs it with --allow-synthetic"
            if synthetic
            else "warning: no --data: this plan trains on random tokens and `llmctl launch` refuses it (pass --data "
            "PATH: a folder made by `llmctl data prepare`, or .txt/.jsonl files; --synthetic for a benchmark)"
        )
    return plan_obj, notes
