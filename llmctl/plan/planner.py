"""The planner: enumerate setups, drop what does not fit, time the rest, rank, explain (torch-free).

What is searched is llmctl.plan.space (each decision the user did not pin, narrowed by the rules); how it is searched
is llmctl.plan.search (families, the Pareto front of recompute per family, the bounds that skip the families with TP,
CP, PP or EP that cannot win); what fits comes from llmctl.plan.memory, what it costs from llmctl.plan.timing; the request is
llmctl.plan.request, the explanations llmctl.plan.explain, the plan file llmctl.plan.emit.

CPU offload (FSDP2's CPUOffloadPolicy): pinned (--offload, --no-offload) every setup searched has it or none has.
Unpinned the search runs without it, then once more with it only where nothing fits without it, or where some
family could win with it (llmctl.plan.search.offload_can_win: its fastest setup, the whole batch without recompute,
does not fit without offload, and that setup's step plus the host's optimizer step, which nothing hides, beats the
best setup without it). Offload frees the GPU of the states, so it can win where they squeeze a setup into recompute,
small micro-batches or TP; its copies and host step only add time to a setup that fits as it is. The faster search
wins and the explanation says why. Under offload a family whose states do not fit the host's memory per node (the
cluster file's node_memory_gib, else the GPU catalog's) is dropped before its memory search.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from llmctl.errors import DoesNotFitError
from llmctl.plan import flops as fl
from llmctl.plan import memory as mem
from llmctl.plan.calibrate import Calibration
from llmctl.plan.explain import (
    explain_cp_choice,
    explain_memory_choice,
    explain_offload,
    explain_precision,
    explain_tp_choice,
    offload_won,
    table_rows,
    why_lost,
)
from llmctl.plan.explain_experts import explain_ep_choice
from llmctl.plan.explain_finetune import explain_finetune
from llmctl.plan.explain_kernels import efficiency_basis, step_split
from llmctl.plan.explain_pipeline import explain_pp_choice
from llmctl.plan.explain_sharding import explain_sharding
from llmctl.plan.memory.margin import tight_warning
from llmctl.plan.ranking import sort_key
from llmctl.plan.request import PlanRequest
from llmctl.plan.search import Search, offload_can_win
from llmctl.plan.space import fastest_families, nothing_fits, space_for
from llmctl.plan.timing import Candidate
from llmctl.spec.setup import TrainSetup

REJECTED_IN_JSON = 50
"""The dropped setup families `--json`'s `rejected` lists (the first; `rejected_count` counts them all)."""


@dataclass(frozen=True)
class PlanResult:
    request: PlanRequest
    chosen: Candidate
    candidates: list[Candidate]
    """Ranked best first; the best setup of each (tp, cp or not, strategy, nodes used, recompute or not) family: the
    alternatives a person weighs (the modes, cp degrees, kernel, loss and compile variants of one family are in
    `variants`; `memory_choice` compares the checkpointing modes of the chosen strategy)."""
    why_lost: dict[int, str]
    """Index into candidates -> one sentence."""
    variants: list[Candidate]
    """Every (tp, strategy, nodes, checkpointing, attention, compile, loss chunk) at its best micro-batch, ranked."""
    rejected: list[str]
    """Why whole families were dropped (does not fit, pins, batch does not split)."""
    evaluated: int
    memory_choice: str = ""
    """Why this checkpointing and loss: what the other modes would fit and cost on the same strategy and nodes."""
    tp_choice: str = ""
    """Why tensor parallelism won or lost: memory freed, share of the step in TP collectives, against the best other."""
    cp_choice: str = ""
    """Why context parallelism was used or not: what one sequence's activations need without it, what the ring costs."""
    precision_choice: str = ""
    """What --precision auto chose on a GPU without bf16 and why; under float8, what runs on its tensor cores."""
    step_split: str = ""  # the chosen step by kind of kernel, with each rate's basis (llmctl.plan.explain_kernels)
    finetune_choice: str = ""  # with adapters: full, LoRA and QLoRA compared here (llmctl.plan.explain_finetune)
    offload_choice: str = ""  # under CPU offload: why it is on, what GPU and host hold, what it costs (else empty)
    pp_choice: str = ""
    """Why pipeline parallelism won or lost: its bubble, its sends, the states and communication it saves, against the
    best of the other kind (empty where the search did not consider it)."""
    sharding_choice: str = ""
    """FULL vs HYBRID on two nodes or more: the best of each, which won and why the other lost (empty on one node;
    llmctl.plan.explain_sharding)."""
    ep_choice: str = ""
    """Why expert parallelism won or lost: the experts a GPU gathers, the grouped GEMMs, the all-to-alls' share of the
    step, against the best of the other kind (empty for a dense model)."""

    def memory_margin(self) -> dict[str, Any]:
        """The chosen setup's memory against the GPU's: what the prediction holds beyond the allocations (allocator
        headroom, CUDA context), the margin kept free (llmctl.plan.memory.margin: by default from measurements), what
        is left free, and a warning when that is under the default margin with a smaller one asked for."""
        req, s = self.request, self.chosen.setup
        est = mem.estimate(req.spec, s)
        total = req.gpu.memory_bytes
        free = total - est.device_bytes
        margin = req.margin
        return {
            "gpu_bytes": total,
            "predicted_bytes": est.device_bytes,
            "allocator_headroom_bytes": est.headroom_bytes,
            "headroom_fraction": s.headroom_fraction,
            "cuda_context_bytes": s.cuda_context_bytes,
            "margin_fraction": req.memory_margin,
            "margin_bytes": margin.bytes,
            "margin": margin.line(),
            "free_bytes": free,
            "free_fraction": free / total,
            "warning": tight_warning(free, total, req.memory_margin, s.headroom_fraction),
        }

    def as_dict(self, top: int, calibration: Calibration | None = None) -> dict[str, Any]:
        """What `llmctl plan --json` prints (the top candidates, and the calibration the request used)."""
        req, cal, result = self.request, calibration, self
        spec, gpu_spec, network = req.spec, req.gpu, req.network

        return {
            "model": spec.name,
            "params": spec.params,
            "active_params_per_token": spec.active_params_per_token,
            "measured": spec.measured is not None,
            "gpu": gpu_spec.name,
            "nodes": req.nodes,
            "gpus_per_node": req.gpus_per_node,
            "seq_len": req.seq_len,
            "global_batch_seqs": req.global_batch,
            "global_batch_why": req.batch_line(result.chosen.predicted.step_time_s),
            "objective": req.objective,
            "network": {
                "source": network.source,
                "intra_busbw_gbytes_s": network.intra_gbytes_s,
                "inter_node_gbytes_s": network.inter_node_gbytes_s,
            },
            "overlap": req.overlap,
            "efficiency": efficiency_basis(req),
            "calibration": None
            if cal is None
            else {
                "factor": cal.factor,
                "steps": cal.steps,
                "measured_tokens_per_s": cal.measured_tokens_per_s,
                "predicted_tokens_per_s": cal.predicted_tokens_per_s,
                "method": cal.method,
            },
            "evaluated": result.evaluated,
            "mfu_convention": {"mfu": fl.CAUSAL_MFU, "mfu_palm": fl.PALM_MFU},
            "chosen": result.chosen.as_dict(),
            "candidates": [c.as_dict() for c in result.candidates[:top]],
            "variants_considered": len(result.variants),
            "why_lost": [result.why_lost[i] for i in range(1, min(top, len(result.candidates)))],
            "memory_choice": result.memory_choice,
            "step_split": result.step_split,
            "tp_choice": result.tp_choice,
            "cp_choice": result.cp_choice,
            # Only where pipelines were searched or pinned, so that the answers without them stay as they were.
            **({"pp_choice": result.pp_choice} if result.pp_choice else {}),
            **({"ep_choice": result.ep_choice} if result.ep_choice else {}),
            "precision": req.precision.name,
            "precision_choice": result.precision_choice,
            # Only when a setup offloads, so that the answers without it stay as they were.
            **({"offload_choice": result.offload_choice} if result.offload_choice else {}),
            **({"finetune_choice": result.finetune_choice} if result.finetune_choice else {}),
            "memory_margin": result.memory_margin(),
            "host_memory": mem.host_memory_of(req.spec, result.chosen.setup, req.host_capacity_bytes).as_dict(),
            **({"sharding_choice": result.sharding_choice} if result.sharding_choice else {}),
            "rejected": list(dict.fromkeys(result.rejected))[:REJECTED_IN_JSON],
            "rejected_count": len(dict.fromkeys(result.rejected)),
            "plan_path": None,
        }


def plan(req: PlanRequest) -> PlanResult:
    """Enumerate, filter by memory, predict, rank. Raises DoesNotFitError with the reasons when nothing is left.
    CPU offload: as pinned, else searched where nothing fits without it or where it could win (module docstring)."""
    if req.finetune.adapters:  # no CPU offload with adapters (llmctl.spec.rules); the methods compared
        result = _plan(req)
        return replace(result, finetune_choice=explain_finetune(req, result.chosen))
    if req.pin("offload") is not None:
        result = _plan(req)
        return replace(result, offload_choice=explain_offload(req, result.chosen, None))
    with_offload = req.with_pins(offload=True)
    try:
        first = _plan(req)
    except DoesNotFitError as without:
        try:
            result = _plan(with_offload, offload_pinned=False)
        except DoesNotFitError as again:
            fewest = min((n for n in (without.fewest_gpus, again.fewest_gpus) if n), default=None)
            raise DoesNotFitError(f"{without.message}; with CPU offload: {again.message}", again.hint, fewest) from None
        why = f"on: no setup fits the GPUs without it ({without.message})"
        return replace(result, offload_choice=explain_offload(with_offload, result.chosen, why))
    if not offload_can_win(req, first.chosen, fastest_families(req)):
        return first
    try:
        second = _plan(with_offload, offload_pinned=False)
    except DoesNotFitError:
        return first
    if sort_key(req, second.chosen) >= sort_key(req, first.chosen):
        return first
    why = offload_won(req, first.chosen, second.chosen)
    return replace(second, offload_choice=explain_offload(with_offload, second.chosen, why))


def _plan(req: PlanRequest, offload_pinned: bool = True) -> PlanResult:
    """One search, with CPU offload as the request says (off when None); `offload_pinned` False: on because nothing
    fit without it, not a pin to drop."""
    space = space_for(req)
    search = Search(req, space)
    search.run()
    if not search.best:
        nothing_fits(req, search.rejected, offload_pinned)
    ranked = sorted(search.best.values(), key=lambda c: sort_key(req, c))[: None if req.explain else 1]
    filled = _with_memory(req, ranked)
    fam = table_rows(filled)
    why = {i: why_lost(c, fam[0], req) for i, c in enumerate(fam) if i > 0}
    choice = explain_memory_choice(req, fam[0], search.memory, space.checkpointing, space.loss_chunks)
    tp_choice = explain_tp_choice(req, fam[0], filled, space.tps, search.pruned)
    cp_choice = explain_cp_choice(req, fam[0], filled, space.cps, search.pruned)
    precision_choice = explain_precision(req, fam[0])
    explained = (choice, tp_choice, cp_choice, precision_choice, step_split(req, fam[0]))
    pp_choice = explain_pp_choice(req, fam[0], filled, space.pps, search.pp_pruned)
    ep_choice = explain_ep_choice(req, fam[0], filled, space.eps)
    sharding = explain_sharding(req, fam[0], filled, search.rejected) if req.explain else ""
    result = PlanResult(req, fam[0], fam, why, filled, search.rejected, search.evaluated, *explained)
    return replace(result, pp_choice=pp_choice, ep_choice=ep_choice, sharding_choice=sharding)


def _with_memory(req: PlanRequest, ranked: list[Candidate]) -> list[Candidate]:
    """The candidates with their memory per GPU (which depends on accumulation only as whether there is any,
    memory_key, not on compile: sized once per key)."""
    sized: dict[TrainSetup, int] = {}
    out = []
    for c in ranked:
        # under pp the accumulation sets the micro-batches in flight a run: the setup is its own key
        k = c.setup if c.setup.pp > 1 else mem.memory_key(c.setup)
        if k not in sized:
            sized[k] = mem.estimate(req.spec, k).device_bytes
        out.append(replace(c, predicted=replace(c.predicted, memory_per_gpu_bytes=sized[k])))
    return out
