"""The fit report `llmctl estimate-memory` prints: one setup's estimate with what follows from it on a GPU kind
(torch-free)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import llmctl.plan.memory.adapters as lora
from llmctl.plan import float8 as f8
from llmctl.plan.flops import adapter_count
from llmctl.plan.memory.activations import DROPOUT_MASK_BYTES, layer_activation_terms
from llmctl.plan.memory.estimate import (
    FLOAT8_NOTE,
    MemoryEstimate,
    estimate,
    fits,
    host_capacity_bytes,
    max_micro_batch,
    min_gpus,
    sequence_parallel_degree,
)
from llmctl.plan.memory.experts import IMBALANCE_NOTE, expert_memory
from llmctl.plan.memory.host import host_memory
from llmctl.plan.memory.ledger import model_bytes_per_param
from llmctl.plan.memory.margin import DEFAULT_MEMORY_MARGIN, Margin
from llmctl.plan.memory.ring import ring_buffers
from llmctl.plan.memory.states import classic_bytes_per_param
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.optimizer_states import AUTO as AUTO_STATES
from llmctl.spec.parallel import STRATEGIES
from llmctl.spec.setup import TrainSetup


def fit_report(
    spec: ModelSpec,
    setup: TrainSetup,
    gpu: GPUSpec | None,
    node_gpus: int | None = None,
    memory_margin: float = DEFAULT_MEMORY_MARGIN,
) -> dict[str, Any]:
    """`llmctl estimate-memory`'s whole answer as plain data (what --json prints and the tables show): the ledger,
    the components by phase, one block's activation terms, and on a GPU whether it fits, the largest micro-batch and
    the fewest GPUs per strategy and per checkpointing mode, in nodes of `node_gpus` GPUs (default: the setup's),
    each with `memory_margin` of the GPU kept free (llmctl.plan.memory.margin). The estimate itself is under
    "_estimate"."""
    est = estimate(spec, setup)
    out = {**_model_report(spec), "setup": _setup_report(setup), **_estimate_report(spec, setup, est)}
    if setup.finetune.adapters:
        out["layer_activation_terms"].update(_adapter_terms(spec, setup))
        out["finetune"] = _finetune_report(spec, setup)
    if setup.cp > 1:
        out["context_parallel"] = context_parallel_report(spec, setup, est)
    if setup.pp > 1:
        out["pipeline"] = pipeline_report(est)
    if setup.ep > 1:
        out["experts"] = experts_report(spec, setup)
    if setup.precision.float8:
        out["float8"] = {**f8.summary(spec, setup.seq_len, setup.precision), "note": FLOAT8_NOTE}
    # CPU offload: the host's memory per GPU where the catalog knows the kind's node (None: not checked).
    host_cap = host_capacity_bytes(gpu, setup.gpus_per_node) if setup.levers.offload else None
    if setup.levers.offload:
        out["offload"] = offload_report(est, host_cap)
    # Every setup's host memory per node (llmctl.plan.memory.host), against the node's where the catalog knows it.
    out["host"] = host_memory(
        spec, setup, est, host_capacity_bytes(gpu, setup.gpus_per_node), gpu is not None
    ).as_dict()
    if gpu is not None:
        out |= _gpu_report(spec, setup, est, gpu, node_gpus, host_cap, Margin(memory_margin, gpu.memory_bytes))
    out["_estimate"] = est
    return out


def _model_report(spec: ModelSpec) -> dict[str, Any]:
    return {
        "model": spec.name,
        "params": spec.params,
        "active_params_per_token": spec.active_params_per_token,
        "measured": spec.measured is not None,
        "shape": spec.describe(),
        "assumed_shape": spec.source == "params",
    }


REPORTED_DECISIONS = (
    *("optimizer", "strategy", "engine", "nodes", "gpus_per_node", "tp", "cp", "pp", "micro_batch_size", "seq_len"),
    *("checkpointing", "attention", "loss_chunk_tokens"),
)
"""The setup's decisions the report repeats, in its order."""


def _setup_report(setup: TrainSetup) -> dict[str, Any]:
    return {
        "precision": setup.precision.name,
        **{k: getattr(setup, k) for k in REPORTED_DECISIONS},
        # Only when asked, so that the answers of setups that do not ask stay as they were.
        **({"optimizer_states": setup.optimizer_states} if setup.optimizer_states != AUTO_STATES else {}),
    }


def _estimate_report(spec: ModelSpec, setup: TrainSetup, est: MemoryEstimate) -> dict[str, Any]:
    """The estimate's numbers: the ledger, the components by phase, one block's terms, the peak."""
    return {
        "bytes_per_param": classic_bytes_per_param(spec, setup),
        "ledger": [
            {
                "name": line.name,
                "bytes_per_param": line.bytes_per_param,
                "sharded_from_zero_stage": line.sharded_from_stage,
                "note": line.note,
                # Only on the adapters' lines (bytes per adapter parameter), so the others read as they always have.
                **({"per_params": line.params} if line.params is not None else {}),
            }
            for line in est.ledger
        ],
        "engine_bytes_per_param": model_bytes_per_param(spec, est.ledger),
        "per_gpu_bytes": est.per_component(),
        "components": [
            {"name": comp.name, "bytes": comp.bytes, "phases": list(comp.phases)} for comp in est.components
        ],
        "phase_bytes": est.phase_bytes,
        # One block without checkpointing, tensor group by group (Hugging Face-only extras named as such).
        "layer_activation_terms": layer_activation_terms(
            spec,
            setup.micro_batch_size,
            setup.dims.rank_shard(setup.seq_len).tokens,
            setup.compute_bytes,
            setup.attention,
            tp=sequence_parallel_degree(spec, setup),
        ),
        "peak_phase": est.peak_phase,
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "per_gpu_total_bytes": est.device_bytes,
        "predicts": "peak allocated bytes (torch.cuda.max_memory_allocated); reserved adds allocator headroom; "
        "total adds the CUDA context",
        "world_size": setup.world_size,
    }


def _adapter_terms(spec: ModelSpec, setup: TrainSetup) -> dict[str, int]:
    """The largest block's terms with the adapters' (llmctl.plan.memory.adapters): what they add and what the frozen
    base no longer keeps."""
    b, s, ab = setup.micro_batch_size, setup.dims.rank_shard(setup.seq_len).tokens, setup.compute_bytes
    layer = max((la for la, _ in spec.layer_groups), key=spec.params_of)
    return lora.adapter_activation_terms(spec, layer, b, s, ab, setup.attention, setup.finetune, DROPOUT_MASK_BYTES)


def _finetune_report(spec: ModelSpec, setup: TrainSetup) -> dict[str, Any]:
    ft, n = setup.finetune, adapter_count(spec, setup.finetune)
    return {
        "method": ft.method,
        "lora_rank": ft.rank,
        "lora_alpha": ft.alpha,
        "lora_dropout": ft.dropout,
        "trainable_params": n,
        "trainable_fraction": n / spec.params,
    }


def _gpu_report(
    spec: ModelSpec,
    setup: TrainSetup,
    est: MemoryEstimate,
    gpu: GPUSpec,
    node_gpus: int | None,
    host_cap: int | None,
    margin: Margin,
) -> dict[str, Any]:
    """On a GPU kind, with the margin kept free: whether it fits, the largest micro-batch, the fewest GPUs per
    strategy and per checkpointing."""
    sized = setup if node_gpus in (None, setup.gpus_per_node) else replace(setup, gpus_per_node=node_gpus)
    cap = margin.capacity_bytes
    table = {}
    for strat in STRATEGIES:
        m = min_gpus(spec, sized, cap, strat, host_memory_bytes=host_cap)
        table[strat] = {"gpus": m.gpus, "nodes": m.nodes, "per_gpu_total_bytes": m.device_bytes, "note": m.note}
    return {
        "gpu": gpu.name,
        "gpu_memory_bytes": gpu.memory_bytes,
        "memory_margin": margin.as_dict(),
        "fits": fits(est, cap, host_cap),
        "max_micro_batch": max_micro_batch(spec, setup, cap, host_memory_bytes=host_cap),
        "node_gpus": sized.gpus_per_node,
        "min_gpus_by_strategy": table,
        "min_gpus": table[setup.strategy]["gpus"],
        "min_gpus_by_checkpointing": _min_gpus_by_checkpointing(spec, setup, sized, cap, host_cap),
        **({"fewest_any_layout": _fewest_any_layout(spec, sized, cap, host_cap)} if setup.engine == "fsdp2" else {}),
    }


def _fewest_any_layout(
    spec: ModelSpec, sized: TrainSetup, capacity: int, host_cap: int | None
) -> dict[str, Any] | None:
    """The fewest GPUs over every layout the planner searches (llmctl.plan.memory.fewest: tp, cp, pp), each at the least
    memory of the other levers (full_shard, full checkpointing, micro-batch 1, the loss in chunks), as `plan` names
    it when nothing fits (llmctl's engine only: the zero engine's ledger has no layout search); None where no count
    of this GPU does."""
    from llmctl.errors import InputError
    from llmctl.plan.memory.fewest import auto_loss_chunk, fewest

    try:
        base = replace(
            sized,
            strategy="full_shard",
            checkpointing="full",
            micro_batch_size=1,
            tp=1,
            cp=1,
            pp=1,
            loss_chunk_tokens=auto_loss_chunk(spec),
        )
    except InputError:  # a rule (or an ep that the 1-node base cannot borrow ranks for): fewest tries the others
        return None
    f = fewest(spec, base, capacity, host_memory_bytes=host_cap)
    return None if f is None else f.as_dict()


def _min_gpus_by_checkpointing(
    spec: ModelSpec, setup: TrainSetup, sized: TrainSetup, capacity: int, host_cap: int | None
) -> dict[str, Any]:
    """The fewest GPUs of the setup's strategy under each checkpointing mode (`capacity` bytes of each usable), with
    that mode's activations."""
    by_mode = {}
    modes = ["none", "selective", "partial:2", "full"]
    if setup.checkpointing not in modes:
        modes.insert(-1, setup.checkpointing)
    for mode in modes:
        if mode.startswith("partial:") and spec.num_layers // int(mode.split(":")[1]) == 0:
            continue
        alt = replace(setup, checkpointing=mode)
        m = min_gpus(spec, replace(sized, checkpointing=mode), capacity, setup.strategy, host_memory_bytes=host_cap)
        acts = sum(comp.bytes for comp in estimate(spec, alt).components if comp.name.startswith("activations"))
        by_mode[mode] = {
            "gpus": m.gpus,
            "nodes": m.nodes,
            "per_gpu_total_bytes": m.device_bytes,
            "activations_bytes": acts,
            "note": m.note,
        }
    return by_mode


def offload_report(est: MemoryEstimate, host_capacity_per_gpu: int | None) -> dict[str, Any]:
    """What CPU offload keeps on the host (the ledger's lines, per GPU and per node) against the node's memory where
    it is known (`host_capacity_per_gpu`: llmctl.plan.memory.host_capacity_bytes)."""
    gpn = est.setup.gpus_per_node
    return {
        "host_components": [{"name": c.name, "bytes": c.bytes} for c in est.host_components],
        "host_bytes_per_gpu": est.host_bytes,
        "host_bytes_per_node": est.host_node_bytes,
        "gpus_per_node": gpn,
        "host_capacity_bytes_per_node": None if host_capacity_per_gpu is None else host_capacity_per_gpu * gpn,
        "host_fits": None if host_capacity_per_gpu is None else est.host_bytes <= host_capacity_per_gpu,
        "pinned": "parameters and gradients pinned, optimizer states not",
    }


def context_parallel_report(spec: ModelSpec, setup: TrainSetup, est: MemoryEstimate) -> dict[str, Any]:
    """What context parallelism does to one rank's memory: the tokens of each sequence it holds, the ring attention's
    transient buffers (llmctl.plan.memory.ring) and the activations it divides (against the same setup at cp 1 on the
    same ranks' states: what splitting the sequence saves)."""
    ring = ring_buffers(spec, setup)

    def activations(e: MemoryEstimate) -> int:
        """What the step keeps for backward and its loss at the peak phase (no states, FSDP or CPU offload buffers, or
        ring)."""
        skip = ("unsharded", "ring", "optimizer step", "offload")
        return sum(
            c.bytes
            for c in e.components
            if e.peak_phase in c.phases and c.bytes_per_param is None and not c.name.startswith(skip)
        )

    whole = estimate(spec, replace(setup, cp=1))
    return {
        "cp": setup.cp,
        "rotate": setup.cp_rotate,
        "load_balance": setup.cp_load_balance,
        "tokens_per_rank": setup.dims.rank_shard(setup.seq_len).tokens,
        "fsdp_shard": setup.dims.fsdp_shard,
        "ring_forward_kv_bytes": ring.forward_kv,
        "ring_forward_merge_bytes": ring.forward_merge,
        "ring_backward_kv_bytes": ring.backward_kv if setup.training else 0,
        "ring_backward_grads_bytes": ring.backward_grads if setup.training else 0,
        "ring_backward_is_recompute": ring.backward_is_recompute,
        "activations_bytes": activations(est),
        "activations_at_cp1_bytes": activations(whole),
        "per_gpu_total_at_cp1_bytes": whole.device_bytes,
    }


def pipeline_report(est: MemoryEstimate) -> dict[str, Any]:
    """Every pp rank's memory (llmctl.plan.memory.estimate's StageMemory), the schedule it comes from and which rank
    is the answer: the heaviest."""
    s = est.setup
    return {
        "schedule": str(s.pp_schedule),
        "microbatches": s.pipeline_microbatches,
        "virtual_stages": s.virtual_stages,
        "stages_total": s.pipeline_stages,
        "heaviest_rank": est.pipeline_rank,
        "ranks": [
            {
                "rank": st.rank,
                "stages": list(st.stages),
                "blocks": st.blocks,
                "params": st.params,
                "params_bytes": st.params_bytes,
                "grads_bytes": st.grads_bytes,
                "states_bytes": st.states_bytes,
                "activations_bytes": st.activations_bytes,
                "in_flight": st.in_flight,
                "peak_phase": st.peak_phase,
                "per_gpu_total_bytes": st.device_bytes,
            }
            for st in est.stages
        ],
    }


def experts_report(spec: ModelSpec, setup: TrainSetup) -> dict[str, Any]:
    """The routed experts on one GPU at the setup's ep (llmctl.plan.memory.experts) next to the same setup at ep 1."""
    at, one = expert_memory(spec, setup), expert_memory(spec, replace(setup, ep=1))
    return {
        "ep": setup.ep,
        "expert_shard": setup.dims.expert_shard,
        "experts": at.experts,
        "local_experts": at.local_experts,
        "params_per_gpu": at.params,
        "states_bytes": at.states_bytes,
        "unsharded_bytes": at.unsharded_bytes,
        "per_gpu_bytes": at.total_bytes,
        "per_gpu_bytes_at_ep1": one.total_bytes,
        "routing": IMBALANCE_NOTE,
    }
