"""Measured throughput, FLOP/s, MFU and memory, next to the plan's predictions; JSONL lines and a progress display.

FLOPs per token come from llmctl.plan.flops (the planner's own formulas, so measured and predicted use the same
convention): model FLOPs = 6N + attention (PaLM appendix B) with causal attention counted half, the FLOPs the
kernels run (llmctl.plan.flops.CAUSAL_MFU), hardware FLOPs x4/3 with full recompute (the "4 * 2" vs "3 * 2" of
docs/sources.md#tune-up-seed, Narayanan et al. 2021 eq. 3). MFU = model FLOP/s per device / the device's dense
catalog peak; `mfu_palm` counts the attention whole as PaLM and torchtitan do (the figure published MFU is quoted in),
next to the plan's `mfu_palm`. A CPU has no catalog peak (it depends on cores, AVX-512/AMX and clocks, and the
cores here are shared), so on a CPU MFU is null rather than a made-up number.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from llmctl.engine.loggers import Sink, scalars
from llmctl.fileio import repair_torn_tail
from llmctl.plan.flops import (
    adapter_recompute_flops_per_token,
    method_flops_per_token,
    recompute_attention_flops_per_token,
    recompute_flops_per_token,
)
from llmctl.spec.finetune import Finetune
from llmctl.spec.models import ModelSpec
from llmctl.spec.planfile import Predicted

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThroughputModel:
    """What one step is worth: tokens, FLOPs per token, and the device peak (None on CPU)."""

    tokens_per_step: int
    world_size: int
    model_flops_per_token: int
    hardware_flops_per_token: int
    peak_tflops: float | None
    palm_flops_per_token: int | None = None
    """Model FLOPs per token with attention counted whole (PaLM); None: as model_flops_per_token."""

    @classmethod
    def for_run(
        cls,
        spec: ModelSpec,
        seq_len: int,
        tokens_per_step: int,
        world_size: int,
        checkpointing: str,
        peak_tflops: float | None,
        attention: str = "sdpa",
        loss_chunked: bool = False,
        finetune: Finetune | None = None,
    ) -> ThroughputModel:
        """`attention` is the plan's kernel family (eager, sdpa or flash): selective checkpointing recomputes eager
        attention's matmuls but keeps a fused kernel's output. With LoRA adapters (`finetune`), the method's FLOPs:
        no weight gradients for the frozen base (llmctl.plan.flops.method_flops_per_token), as the planner's MFU."""
        model = sum(method_flops_per_token(spec, seq_len, finetune, causal=True))
        rerun = recompute_flops_per_token(spec, seq_len, checkpointing, attention, loss_chunked)
        # what checkpointing re-runs of the attention is causal too: half of it runs
        rerun -= recompute_attention_flops_per_token(spec, seq_len, checkpointing, attention) // 2
        return cls(
            tokens_per_step,
            world_size,
            model,
            model + rerun + adapter_recompute_flops_per_token(spec, checkpointing, finetune),
            peak_tflops,
            sum(method_flops_per_token(spec, seq_len, finetune)),
        )

    def measure(self, step_time_s: float) -> dict[str, float | None]:
        tps = self.tokens_per_step / step_time_s
        per_dev = tps / self.world_size
        model_tflops = self.model_flops_per_token * per_dev / 1e12
        return {
            "step_time_s": step_time_s,
            "tokens_per_s": tps,
            "tokens_per_s_per_gpu": per_dev,
            "model_tflops_per_gpu": model_tflops,
            "hardware_tflops_per_gpu": self.hardware_flops_per_token * per_dev / 1e12,
            "mfu": model_tflops / self.peak_tflops if self.peak_tflops else None,
            "mfu_palm": self.palm_flops_per_token * per_dev / 1e12 / self.peak_tflops
            if self.peak_tflops and self.palm_flops_per_token is not None
            else None,
        }


PHASES = ("forward", "backward", "optimizer")


class PhasePeaks:
    """Peak allocated bytes by phase of the step (CUDA): the end of each micro-batch's forward (the loss computed,
    its logits still alive), its backward, and the optimizer step, which is how the memory estimate splits a step
    (llmctl.plan.memory.estimate's phases). The allocator's peak is read and reset at each boundary (a host call, no
    synchronization); the running maxima keep the whole run's peak. Off on a CPU (no allocator to read)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.allocated = dict.fromkeys(PHASES, 0)
        self.reserved = 0

    def mark(self, phase: str) -> None:
        if not self.on:
            return
        import torch

        self.allocated[phase] = max(self.allocated[phase], int(torch.cuda.max_memory_allocated()))
        self.reserved = max(self.reserved, int(torch.cuda.max_memory_reserved()))
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device_type: str, phases: PhasePeaks | None = None) -> dict[str, Any]:
    """CUDA: max allocated/reserved by the caching allocator (over the phases `phases` has read and reset), the peak
    of each phase, and how many times the allocator retried an allocation after freeing its cache
    (`num_alloc_retries`: each one synchronizes and frees every cached block, a slow step; the largest micro-batch
    that fits often has them, fms-fsdp issue 63). CPU: the process's peak resident set size."""
    if device_type == "cuda":
        import torch

        seen = phases if phases is not None and phases.on else PhasePeaks(False)
        return {
            "peak_mem_allocated_bytes": max(int(torch.cuda.max_memory_allocated()), *seen.allocated.values()),
            "peak_mem_reserved_bytes": max(int(torch.cuda.max_memory_reserved()), seen.reserved),
            "peak_mem_phase_bytes": dict(seen.allocated) if seen.on else None,
            "alloc_retries": int(torch.cuda.memory_stats().get("num_alloc_retries", 0)),
            "peak_rss_bytes": None,
        }
    # ru_maxrss is in KiB on Linux (getrusage(2)); bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "peak_mem_allocated_bytes": None,
        "peak_mem_reserved_bytes": None,
        "peak_rss_bytes": int(rss if sys.platform == "darwin" else rss * 1024),
    }


def with_predictions(record: dict[str, Any], predicted: Predicted) -> dict[str, Any]:
    """Put each plan prediction right after the measured value it predicts."""
    pairs = {
        "tokens_per_s": predicted.tokens_per_s,
        "tokens_per_s_per_gpu": predicted.tokens_per_s_per_gpu,
        "mfu": predicted.mfu,
        "mfu_palm": predicted.mfu_palm,
        "step_time_s": predicted.step_time_s,
    }
    mem_key = "peak_mem_reserved_bytes" if record.get("peak_mem_reserved_bytes") is not None else "peak_rss_bytes"
    pairs[mem_key] = predicted.memory_per_gpu_bytes
    out: dict[str, Any] = {}
    for k, v in record.items():
        out[k] = v
        if k in pairs:
            out[f"{k}_predicted"] = pairs[k]
    return out


def open_jsonl(path: Path) -> int:
    """metrics.jsonl opened for appending, its torn last line (a run killed mid-write) repaired first, so that this
    run's first line is not glued to it (which made `plan --calibrate` refuse the whole file). Issue 46."""
    path.parent.mkdir(parents=True, exist_ok=True)
    repaired = repair_torn_tail(path)
    if repaired is not None:
        how, nbytes = repaired
        what = "ended with its missing newline" if how == "newline" else "dropped (a cut line)"
        log.warning("%s: its last line (%d bytes, a run killed mid-write) %s", path, nbytes, what)
    # O_APPEND: every write lands at the end, even if another writer appended meanwhile.
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)


def append_line(fd: int, line: str) -> None:
    """One line in one write (a kill leaves whole lines, or one cut line that the next open repairs); a short write
    (a full disk's last bytes) is finished by the next."""
    data = line.encode()
    while data:
        data = data[os.write(fd, data) :]


class MetricsLog:
    """metrics.jsonl (appended across resumes: one line per event) and the human display, rank 0 only."""

    def __init__(
        self, path: Path | None, total_steps: int, stream: TextIO | None = None, sinks: Sequence[Sink] = ()
    ) -> None:
        self.path = path
        self.total_steps = total_steps
        self.sinks = list(sinks)
        """TensorBoard / W&B (llmctl.engine.loggers): they get the numbers of step and eval records."""
        self.stream = stream if stream is not None else sys.stdout
        self._fd: int | None = None
        if path is not None:
            self._fd = open_jsonl(path)
        self._progress = None
        self._task = None
        if self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    def event(self, record: dict[str, Any]) -> None:
        if self._fd is not None:
            append_line(self._fd, json.dumps(record) + "\n")
        if record.get("event") in ("step", "eval") and self.sinks:
            values = scalars(record)
            for sink in self.sinks:
                sink.log(int(record["step"]), values)
        if record.get("event") == "step":
            info = (
                f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  {record['tokens_per_s']:,.0f} tok/s  "
                f"{record['step_time_s'] * 1e3:.0f} ms/step"
            )
            if "loss_scale" in record:  # fp16: the scale, and the overflowed steps skipped so far
                skipped = f", step skipped ({record['skipped_steps']} so far)" if record.get("skipped") else ""
                info += f"  scale {record['loss_scale']:g}{skipped}"
            if self._progress is not None:
                self._progress.update(self._task, completed=record["step"], info=info)
            else:
                print(f"step {record['step']}/{self.total_steps}  {info}", file=self.stream, flush=True)
        elif record.get("message"):
            text = f"[{record['event']}] {record['message']}"
            if self._progress is not None:
                self._progress.console.print(text)
            else:
                print(text, file=self.stream, flush=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self._progress is not None:
            self._progress.stop()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
