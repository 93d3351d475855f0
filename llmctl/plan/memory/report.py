"""The fit report `llmctl estimate-memory` prints: one setup's estimate with what follows from it on a GPU kind
(torch-free)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmctl.plan.memory.activations import layer_activation_terms
from llmctl.plan.memory.estimate import estimate, fits, max_micro_batch, min_gpus
from llmctl.plan.memory.ledger import classic_bytes_per_param
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import STRATEGIES
from llmctl.spec.setup import TrainSetup


def fit_report(spec: ModelSpec, setup: TrainSetup, gpu: GPUSpec | None, node_gpus: int | None = None) -> dict[str, Any]:
    """`llmctl estimate-memory`'s whole answer as plain data (what --json prints and the tables show): the ledger,
    the components by phase, one block's activation terms, and on a GPU whether it fits, the largest micro-batch and
    the fewest GPUs per strategy and per checkpointing mode, in nodes of `node_gpus` GPUs (default: the setup's). The
    estimate itself is under "_estimate"."""
    est = estimate(spec, setup)
    out: dict[str, Any] = {
        "model": spec.name,
        "params": spec.params,
        "active_params_per_token": spec.active_params_per_token,
        "measured": spec.measured is not None,
        "shape": spec.describe(),
        "assumed_shape": spec.source == "params",
        "setup": {
            "precision": setup.precision.name,
            **{
                k: getattr(setup, k)
                for k in (
                    "optimizer",
                    "strategy",
                    "engine",
                    "nodes",
                    "gpus_per_node",
                    "tp",
                    "pp",
                    "micro_batch_size",
                    "seq_len",
                    "checkpointing",
                    "attention",
                    "loss_chunk_tokens",
                )
            },
        },
        "bytes_per_param": classic_bytes_per_param(spec, setup),
        "ledger": [
            {
                "name": line.name,
                "bytes_per_param": line.bytes_per_param,
                "sharded_from_zero_stage": line.sharded_from_stage,
                "note": line.note,
            }
            for line in est.ledger
        ],
        "engine_bytes_per_param": sum(line.bytes_per_param for line in est.ledger),
        "per_gpu_bytes": est.per_component(),
        "components": [
            {"name": comp.name, "bytes": comp.bytes, "phases": list(comp.phases)} for comp in est.components
        ],
        "phase_bytes": est.phase_bytes,
        # One block without checkpointing, tensor group by group (Hugging Face-only extras named as such).
        "layer_activation_terms": layer_activation_terms(
            spec,
            setup.micro_batch_size,
            setup.seq_len,
            setup.compute_bytes,
            setup.attention,
            tp=setup.tp if setup.engine == "fsdp2" and spec.measured is None else 1,
        ),
        "peak_phase": est.peak_phase,
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "per_gpu_total_bytes": est.device_bytes,
        "predicts": "peak allocated bytes (torch.cuda.max_memory_allocated); reserved adds allocator headroom; "
        "total adds the CUDA context",
        "world_size": setup.world_size,
    }
    if gpu is not None:
        out["gpu"] = gpu.name
        out["gpu_memory_bytes"] = gpu.memory_bytes
        out["fits"] = fits(est, gpu.memory_bytes)
        out["max_micro_batch"] = max_micro_batch(spec, setup, gpu.memory_bytes)
        sized = setup if node_gpus in (None, setup.gpus_per_node) else replace(setup, gpus_per_node=node_gpus)
        table = {}
        for strat in STRATEGIES:
            m = min_gpus(spec, sized, gpu.memory_bytes, strat)
            table[strat] = {"gpus": m.gpus, "nodes": m.nodes, "per_gpu_total_bytes": m.device_bytes, "note": m.note}
        out["node_gpus"] = sized.gpus_per_node
        out["min_gpus_by_strategy"] = table
        out["min_gpus"] = table[setup.strategy]["gpus"]
        by_mode = {}
        modes = ["none", "selective", "partial:2", "full"]
        if setup.checkpointing not in modes:
            modes.insert(-1, setup.checkpointing)
        for mode in modes:
            if mode.startswith("partial:") and spec.num_layers // int(mode.split(":")[1]) == 0:
                continue
            alt = replace(setup, checkpointing=mode)
            m = min_gpus(spec, replace(sized, checkpointing=mode), gpu.memory_bytes, setup.strategy)
            acts = sum(comp.bytes for comp in estimate(spec, alt).components if comp.name.startswith("activations"))
            by_mode[mode] = {
                "gpus": m.gpus,
                "nodes": m.nodes,
                "per_gpu_total_bytes": m.device_bytes,
                "activations_bytes": acts,
                "note": m.note,
            }
        out["min_gpus_by_checkpointing"] = by_mode
    out["_estimate"] = est
    return out
