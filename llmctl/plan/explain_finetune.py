"""Why LoRA (or QLoRA, or full training): the three methods compared on the request's hardware, in a few lines
(torch-free). Asked for with `llmctl plan --finetune lora|qlora`.

For each method: the fewest GPUs of the request's kind that fit it (FSDP full_shard at micro-batch 1 with full
checkpointing, the setup that needs the least memory: llmctl.plan.memory.min_gpus), and its predicted tokens/s on the
chosen setup's GPUs: the chosen setup trained that way, else sharded (full_shard where it replicates), with selective
then full checkpointing, else one sequence per micro-batch with full checkpointing and accumulation; "does not fit"
where none does. A handful of estimates and timings, not a
search per method: the plan stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llmctl.errors import LlmctlError
from llmctl.plan import memory as mem
from llmctl.plan.request import PlanRequest
from llmctl.plan.timing import Candidate, evaluate
from llmctl.spec.finetune import Finetune
from llmctl.spec.rules import model_problem

METHODS = ("full", "lora", "qlora")


@dataclass(frozen=True)
class MethodOutcome:
    method: str
    min_gpus: int | None
    """Fewest GPUs of the kind that fit (None: none up to the search's limit)."""
    tokens_per_s: float | None
    """Predicted on the chosen setup's GPUs (None: does not fit there)."""
    how: str = ""
    """What the setup timed differs in from the chosen one ('' : the same)."""
    why_not: str = ""
    """The one line a method is refused with on this request (fp32 QLoRA, ...)."""


def _finetune(req: PlanRequest, method: str) -> Finetune:
    ft = req.finetune
    return Finetune(method, ft.rank, ft.alpha, ft.dropout, ft.targets)


def compare_methods(req: PlanRequest, chosen: Candidate) -> list[MethodOutcome]:
    """Full, LoRA and QLoRA on the request's GPUs (module docstring); the chosen setup's own adapters' rank and
    targets for both adapter methods."""
    out = []
    s = chosen.setup
    per_rank = s.micro_batch_size * s.grad_accum_steps
    for method in METHODS:
        try:
            base = replace(s, finetune=_finetune(req, method))
            if (err := model_problem(base, req.spec, only=("nf4 base", "lora targets"))) is not None:
                out.append(MethodOutcome(method, None, None, why_not=err.message))
                continue
            frugal = replace(base, strategy="full_shard", micro_batch_size=1, grad_accum_steps=1, checkpointing="full")
        except LlmctlError as e:
            out.append(MethodOutcome(method, None, None, why_not=e.message))
            continue
        least = mem.min_gpus(req.spec, frugal, req.capacity_bytes, "full_shard", max_nodes=max(req.nodes, 64))
        sharded = replace(base, strategy="full_shard") if s.strategy == "no_shard" else base
        what = "full_shard, " if sharded is not base else ""
        tried = [
            (base, ""),
            (sharded, what.removesuffix(", ")),
            (replace(sharded, checkpointing="selective"), f"{what}selective checkpointing"),
            (replace(sharded, checkpointing="full"), f"{what}full checkpointing"),
            (
                replace(sharded, checkpointing="full", micro_batch_size=1, grad_accum_steps=per_rank),
                f"{what}full checkpointing, micro-batch 1 x {per_rank}",
            ),
        ]
        tps, how = None, ""
        for setup, what in tried:
            if mem.estimate(req.spec, mem.memory_key(setup)).device_bytes <= req.capacity_bytes:
                tps, how = evaluate(req, setup).predicted.tokens_per_s, what
                break
        out.append(MethodOutcome(method, least.gpus, tps, how))
    return out


def explain_finetune(req: PlanRequest, chosen: Candidate) -> str:
    """A few lines: per method the fewest GPUs that fit and its tokens/s on the chosen GPUs (or 'does not fit')."""
    n, kind = chosen.setup.gpus, req.gpu.name
    gpus = f"{n} GPU{'s' if n > 1 else ''}"
    lines = []
    for o in compare_methods(req, chosen):
        label = o.method if o.method == "full" else f"{o.method} r{req.finetune.rank}"
        if o.why_not:
            lines.append(f"{label}: not run here ({o.why_not})")
            continue
        fewest = f"fits on {o.min_gpus} {kind}" if o.min_gpus else f"does not fit on {kind} (any count searched)"
        at = (
            f"{o.tokens_per_s:,.0f} tokens/s on {gpus}" + (f" ({o.how})" if o.how else "")
            if o.tokens_per_s is not None
            else f"does not fit on {gpus}"
        )
        lines.append(f"{label}: {fewest}; {at}")
    return "; ".join(lines)
