"""`llmctl launch PLAN --dry-start`: will this plan start? The engine's setup for rank 0 of the plan's world, in one
local process, in seconds, before any queue wait.

A fake process group of the plan's world size (torch's `FakeProcessGroup`: collectives return at once, as in
torchtitan's memory estimator) stands in for the cluster, so a 64-GPU plan is checked on a laptop. Then exactly
what a rank does at start: the data source (its files, metadata, vocabulary), the mesh from the plan's degrees,
the model built on the meta device, AC -> compile -> fully_shard, rank 0's shard materialized on the CPU and
given values (random init or its slices of model.weights), the real optimizer over the sharded parameters.

Gradients and optimizer states are sized from that optimizer's parameter groups without allocating them (AdamW
keeps exp_avg and exp_avg_sq like each parameter, plus max_exp_avg_sq with amsgrad, plus a 4-byte step), so a
laptop can check a 64-GPU plan; `--allocate-all` allocates them too (zero gradients and one optimizer step) and
reports the measured bytes. The figures are set next to what `estimate-memory` predicts for the same ledger lines.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.errors import InputError
from llmctl.spec.attention import Attention

if TYPE_CHECKING:
    import torch

    from llmctl.spec.models import ModelSpec
    from llmctl.spec.planfile import Plan
    from llmctl.spec.setup import TrainSetup

log = logging.getLogger("llmctl.engine")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes AdamW will allocate for its states over these (local) parameters, without allocating them:
    exp_avg + exp_avg_sq shaped and typed like each parameter (+ max_exp_avg_sq with amsgrad), and the `step`
    (a float32 scalar tensor per parameter). `--allocate-all` checks this against the real allocation."""
    from llmctl.engine.adamw_states import planned_state_bytes
    from llmctl.engine.materialize import local_block

    if type(optimizer).__name__ != "AdamW":  # bf16 or 8-bit moments (optimizer.states)
        planned = planned_state_bytes(optimizer)
        if planned is None:
            raise InputError(f"dry-start sizes AdamW states only, not {type(optimizer).__name__}")
        return planned
    total = 0
    for group in optimizer.param_groups:
        per = 3 if group.get("amsgrad") else 2
        for p in group["params"]:
            local = local_block(p)[0]
            total += per * local.numel() * local.element_size() + 4
    return total


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: a wrapper subclass's inner tensors (torchao's 8-bit state: int8 codes, fp32 block
    scales and its code book), else numel x element size."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        return sum(tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def allocated_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    import torch

    from llmctl.engine.materialize import local_block

    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += tensor_bytes(local_block(v)[0] if v.ndim else v)
    return total


def estimated_lines(spec: ModelSpec, p: TrainSetup) -> dict[str, int]:
    """estimate-memory's fsdp2 ledger for `spec`, the model as the engine builds it (model_spec_for: padded
    vocabulary), trained as `p`: bytes per rank of parameters, gradients and optimizer states
    (llmctl.plan.memory.state_ledger / the FSDP group: dp_shard x cp)."""
    from llmctl.plan import memory as mem
    from llmctl.spec.optimizer_states import AUTO as AUTO_STATES
    from llmctl.spec.setup import TrainSetup

    setup = TrainSetup(
        precision=p.precision, optimizer="adamw", engine="fsdp2", tp=p.tp, gpus_per_node=p.tp, finetune=p.finetune
    )
    # 8-bit states are exact per rank of the plan's world, not per parameter; an NF4 base's scale blocks depend on it
    if p.optimizer_states != AUTO_STATES or p.finetune.method == "qlora":
        setup = dataclasses.replace(p, optimizer="adamw", engine="fsdp2")
    held, _ = mem.stage_params(spec, setup)  # after the tp split (norms replicated)
    shard = p.dims.fsdp_shard
    out: dict[str, int] = {}
    for line in mem.state_ledger(spec, setup):
        # LoRA: the frozen base and the adapters are both parameters; the adapters' lines count per adapter parameter
        key = "parameters" if line.name.startswith(("param", "frozen base", "LoRA adapters")) else line.name.split()[0]
        if key not in ("parameters", "gradients", "optimizer"):
            continue
        if line.rank_bytes is not None:
            out[key] = out.get(key, 0) + line.rank_bytes  # exact per rank (8-bit states: what torchao quantizes)
        elif line.bytes_per_param:
            count = held if line.params is None else line.params
            out[key] = out.get(key, 0) + math.ceil(count * line.bytes_per_param / shard)
    return out


def dry_start(plan: Plan, allocate_all: bool = False, rank: int = 0) -> dict[str, Any]:
    """Rank `rank`'s setup of the plan in this process (see the module doc). Returns the report."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmctl.engine.data import RankData
    from llmctl.engine.loggers import check_installed
    from llmctl.engine.materialize import WeightFiles, held_bytes, local_block, slots
    from llmctl.engine.model import Values, base_spec, build_meta_model, materialize, model_spec_for
    from llmctl.engine.optim import build_optimizer
    from llmctl.engine.parallelize import build_mesh, parallelize
    from llmctl.engine.trainer import data_source, max_rss_bytes, val_data_source

    t0 = time.perf_counter()
    world = plan.world_size
    if not 0 <= rank < world:
        raise InputError(f"--rank {rank} is outside the plan's world of {world}")
    t = plan.training
    notes: list[str] = []
    setup = plan.setup
    spec = model_spec_for(plan.model)
    vocab = base_spec(plan.model).vocab_size
    blocks, data_desc = data_source(plan.data, plan.model.weights, setup, t.seed, vocab)
    val_data_source(plan.data, plan.model.weights, setup, vocab)  # validation data: present, same tokenizer, a block
    check_installed(plan.logging)
    weights = WeightFiles.scan(plan.model.weights) if plan.model.weights else None
    dims = setup.dims
    RankData(blocks, t.micro_batch_size, t.grad_accum_steps, dims.dp_rank(rank), dims.dp)
    if plan.checkpoint.dir:
        from llmctl.engine.resume import plan_fingerprint

        notes += _resume_notes(Path(plan.checkpoint.dir), setup.finetune.adapters, plan_fingerprint(plan))
    # The kernel does not change what is allocated at setup: build with SDPA here, say what the target picks.
    if setup.attention in (Attention.FLASH, Attention.AUTO):
        notes.append(
            f"attention {setup.attention}: chosen on the target machine (flash-attn needs CUDA); built with sdpa"
        )
    if dist.is_initialized():
        raise InputError("dry-start needs a process of its own (a process group already exists)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = build_mesh(dims, "cpu")
        timings: dict[str, float] = {"data": time.perf_counter() - t0}
        t1 = time.perf_counter()
        model = build_meta_model(spec, setup, "sdpa")
        timings["build on meta"] = time.perf_counter() - t1
        rss_base = max_rss_bytes()
        t1 = time.perf_counter()
        full = model
        if dims.pp_enabled:  # this rank's pipeline stages, as the trainer cuts them (llmctl.engine.pipeline)
            model, fsdp, made = _stages(model, setup, mesh, Values(t.seed, vocab, weights), timings)
            notes.append(
                f"pp {setup.pp}: rank {rank} holds stages {list(_stage_ids(setup, mesh))} of "
                f"{setup.pipeline_stages}; the estimate column is not per stage here"
            )
        else:
            fsdp = parallelize(model, spec, setup, mesh)
            if dims.ep_enabled:
                local = spec.num_experts // setup.ep
                notes.append(
                    f"ep {setup.ep}: rank {rank} holds {local} of every MoE layer's {spec.num_experts} routed experts, "
                    f"FSDP-sharded over {dims.expert_shard} rank{'s' if dims.expert_shard > 1 else ''}"
                )
            timings["parallelize"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            made = materialize(model, setup, torch.device("cpu"), Values(t.seed, vocab, weights))
            timings["materialize"] = time.perf_counter() - t1
        rss_model = max_rss_bytes()
        optimizer = build_optimizer(model, plan.optimizer, "cpu")
        all_slots = slots(model)
        trained = [s for s in all_slots if s.param.requires_grad]  # LoRA: the adapters only
        param_bytes = sum(held_bytes(s.local) for s in all_slots)  # an NF4 weight (QLoRA): its packed tensors
        # FSDP2's sharded gradients: the parameter's (fp32 master) dtype and shard, for the parameters that train
        grad_bytes = sum(s.local.numel() * s.local.element_size() for s in trained)
        opt_bytes = optimizer_state_bytes(optimizer)
        measured: dict[str, int] = {}
        if allocate_all:
            for s in trained:
                s.param.grad = torch.zeros_like(s.param)
            measured["gradients"] = sum(local_block(s.param.grad)[0].nbytes for s in trained)
            optimizer.step()
            measured["optimizer"] = allocated_state_bytes(optimizer)
        layer0 = sum(p.numel() for p in next(iter(_layers(full))).parameters())
    finally:
        dist.destroy_process_group()
    est = {} if dims.pp_enabled else estimated_lines(spec, setup)
    lines = {"parameters": param_bytes, "gradients": grad_bytes, "optimizer": opt_bytes}
    rows = _rows(lines, measured, est)
    return {
        "plan": plan.name,
        "rank": rank,
        "world_size": world,
        "mesh": list(dims.mesh_dims[0]),
        "mesh_dims": list(dims.mesh_dims[1]),
        "fsdp2": fsdp,
        "params": spec.params,
        "layer_params": layer0,
        "init": made.source,
        "data": data_desc,
        "lines": rows,
        "rss_before_model_bytes": rss_base,
        "rss_after_model_bytes": rss_model,
        "rss_peak_bytes": max_rss_bytes(),
        "allocate_all": allocate_all,
        "seconds": time.perf_counter() - t0,
        "timings_s": timings,
        "notes": notes,
    }


def _resume_notes(checkpoints: Path, adapters: bool, fingerprint: dict[str, Any]) -> list[str]:
    """What a launch would resume from (the newest checkpoint in `checkpoints`), and whether the plan (its
    `fingerprint`) changed since."""
    from llmctl.engine.checkpoint import latest_checkpoint

    found = latest_checkpoint(checkpoints)
    if not found:
        return []
    wins = "its adapters on the base" if adapters else "its weights win over model.weights"
    notes = [f"would resume from {found[1]} (step {found[0]}); {wins}"]
    from llmctl.engine.resume import resume_note

    note = resume_note(fingerprint, found[1])
    return [*notes, note] if note else notes


def _rows(lines: dict[str, int], measured: dict[str, int], est: dict[str, int]) -> list[dict[str, Any]]:
    """The report's lines: held bytes, allocated where measured (--allocate-all), the estimate and their ratio."""
    return [
        {
            "line": k,
            "bytes": v,
            "allocated_bytes": measured.get(k, v if k == "parameters" else None),
            "estimate_bytes": est.get(k),
            "ratio": (v / est[k]) if est.get(k) else None,
        }
        for k, v in lines.items()
    ]


def _layers(model: torch.nn.Module) -> Any:
    from llmctl.families.modules import decoder_layers

    return decoder_layers(model)


def _stage_ids(setup: TrainSetup, mesh: Any) -> tuple[int, ...]:
    from llmctl.spec.pipeline import stages_of_rank

    return stages_of_rank(setup.pp_schedule, mesh["pp"].get_local_rank(), setup.pp, setup.virtual_stages)


def _stages(full: torch.nn.Module, setup: TrainSetup, mesh: Any, values: Any, timings: dict[str, float]) -> tuple:
    """(this rank's stages as one module list, whether FSDP2 applies, the first stage's Materialized): cut,
    parallelized and materialized as Trainer._build_stages does."""
    import torch

    from llmctl.engine.model import materialize
    from llmctl.engine.pipeline import parallelize_stage, split_model, stage_parts

    t1 = time.perf_counter()
    parts = split_model(full, setup, mesh["pp"].get_local_rank(), mesh)
    fsdp = False
    for _, part in parts:
        fsdp = parallelize_stage(part, setup, mesh)
    timings["parallelize"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    made = [materialize(part, setup, torch.device("cpu"), values) for _, part in parts]
    timings["materialize"] = time.perf_counter() - t1
    return stage_parts([m for _, m in parts], full), fsdp, made[0]
