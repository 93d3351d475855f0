"""Measured vs planned, once, after warm-up: the engine's own check that the run is what `llmctl plan` promised.

A run that is far slower than planned, or uses more memory, is worth one warning while someone is still watching
(a 4-node job no faster than one node went unnoticed in torchtitan #708). After `logging.check_after_steps` steps past
the (re)start, the first logged window that starts there is judged against the plan's `predicted` block:

- tokens/s more than `logging.check_slower` (default 30%) below the prediction, or
- peak reserved memory (CUDA) more than `logging.check_memory` (default 10%) above the predicted memory per GPU;
- any allocation the CUDA caching allocator had to retry after freeing its cache (`num_alloc_retries`, fms-fsdp
  issue 63: the largest micro-batch that fits is often slower for them).
  On the CPU there is no allocator to read: the process RSS holds the interpreter and libraries, so memory is not
  judged there.

The verdict is one `plan_check` event in metrics.jsonl (measured, predicted, ratio, and `ok`), with a message (the
warning, printed with the run's progress) only when it is off, naming the causes the engine can see: the plan predicted a GPU and this run has
none; time spent waiting for batches (data loading); torch.compile recompiling after warm-up; otherwise compute or
exposed communication, which `llmctl bench-net` and the plan's bandwidth tell apart. Pure functions here (judge),
the loop feeds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmctl.spec.planfile import Predicted

DATA_WAIT_CAUSE = 0.10
"""Waiting for batches more than this fraction of the step time is named as a cause."""


@dataclass
class Clues:
    """What the loop saw during the judged window."""

    device: str
    """cpu or cuda."""
    planned_gpu: str | None
    """hardware.gpu of the plan (what the prediction assumed)."""
    data_wait_fraction: float = 0.0
    """Time waiting for the next batch / step time, over the window."""
    recompiles: int = 0
    """torch.compile frames compiled during the window (after warm-up: recompilation)."""


@dataclass
class Verdict:
    ok: bool
    record: dict[str, Any] = field(default_factory=dict)


def judge(
    step: int,
    measured: dict[str, Any],
    predicted: Predicted,
    clues: Clues,
    slower: float = 0.3,
    memory: float = 0.1,
) -> Verdict:
    """Compare one step record's measurements with the plan's predictions. `measured` is the engine's step record
    (tokens_per_s, mfu, peak_mem_reserved_bytes). Nothing predicted: ok, nothing to say."""
    rec: dict[str, Any] = {"event": "plan_check", "step": step}
    problems: list[str] = []
    tps, want = measured.get("tokens_per_s"), predicted.tokens_per_s
    if tps is not None and want:
        rec.update(tokens_per_s=tps, tokens_per_s_predicted=want, tokens_per_s_ratio=tps / want)
        if tps < (1 - slower) * want:
            problems.append(f"{tps:,.0f} tokens/s is {1 - tps / want:.0%} below the planned {want:,.0f}")
    if measured.get("mfu") is not None and predicted.mfu:
        rec.update(mfu=measured["mfu"], mfu_predicted=predicted.mfu)
    mem, mem_want = measured.get("peak_mem_reserved_bytes"), predicted.memory_per_gpu_bytes
    if clues.device == "cuda" and mem is not None and mem_want:
        rec.update(peak_mem_reserved_bytes=mem, memory_per_gpu_bytes_predicted=mem_want, memory_ratio=mem / mem_want)
        if mem > (1 + memory) * mem_want:
            problems.append(
                f"peak reserved memory {mem / 2**30:.1f} GiB is {mem / mem_want - 1:.0%} above the planned "
                f"{mem_want / 2**30:.1f} GiB"
            )
    retries = measured.get("alloc_retries")
    if clues.device == "cuda" and retries:
        rec["alloc_retries"] = retries
        problems.append(
            f"the CUDA caching allocator retried {retries} allocation{'s' if retries > 1 else ''} after freeing its "
            "cache (each retry stalls the step): re-plan with --memory-margin 0.1 or a smaller --micro-batch"
        )
    rec["ok"] = not problems
    if not problems:
        return Verdict(True, rec)
    causes = likely_causes(clues)
    rec["causes"] = causes
    rec["message"] = f"step {step}: {'; '.join(problems)}. Likely: {'; '.join(causes)}"
    return Verdict(False, rec)


def likely_causes(clues: Clues) -> list[str]:
    """What the engine can see that explains a slow run, most telling first."""
    causes = []
    if clues.device != "cuda" and clues.planned_gpu:
        causes.append(f"this run has no GPU ({clues.device}) and the plan predicted {clues.planned_gpu}")
    if clues.data_wait_fraction > DATA_WAIT_CAUSE:
        causes.append(
            f"data loading: {clues.data_wait_fraction:.0%} of the step time waiting for batches "
            "(more data workers, or pre-tokenized data: llmctl data prepare)"
        )
    if clues.recompiles:
        causes.append(
            f"torch.compile recompiled {clues.recompiles} frame{'s' if clues.recompiles > 1 else ''} after warm-up "
            "(shapes or guards changing between steps)"
        )
    if not causes:
        causes.append(
            "compute below the planned efficiency, or communication not hidden behind it: measure the network with "
            "`llmctl bench-net` and re-plan with --net, or calibrate with `llmctl plan --calibrate metrics.jsonl`"
        )
    return causes


def compiled_frames() -> int:
    """Frames torch.compile has compiled so far in this process (0 when dynamo was never used)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))
