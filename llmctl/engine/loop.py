"""The training loop one rank runs: set up (process group, model, FSDP2, optimizer, data, resume), then step.

Per optimizer step: `grad_accum_steps` micro-batches; gradients are reduce-scattered inside the shard group every
micro-batch (they stay sharded) and all-reduced across replicas (HYBRID, no_shard) only on the last one
(`set_requires_all_reduce`); the loss kept on the device (no host sync in the micro-batch
loop), gradient clipping, AdamW (fused kernel on CUDA and CPU), warm-up + cosine LR. Host syncs happen only at
step boundaries: the stop-signal agreement (a CPU all-reduce) and, on logging steps, the loss.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.engine.checkpoint import Checkpointer, StopSignal, latest_checkpoint
from llmctl.engine.data import Batch, RankData, build_source, build_val_source, expected_tokenizers
from llmctl.engine.evaluate import Evaluator
from llmctl.engine.livecheck import Clues, compiled_frames, judge
from llmctl.engine.loggers import check_installed, new_run_id, open_sinks
from llmctl.engine.loss import install_loss_forward, liger_importable, select_loss, whole_loss
from llmctl.engine.metrics import MetricsLog, ThroughputModel, peak_memory, with_predictions
from llmctl.engine.model import (
    base_spec,
    build_meta_model,
    flash_attn_importable,
    materialize,
    model_spec_for,
    param_dtype_name,
    select_attention,
    select_device,
)
from llmctl.engine.parallelize import build_mesh, parallelize
from llmctl.errors import SpecError
from llmctl.spec.planfile import OptimizerSection, Plan, plan_to_yaml

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmctl.engine")


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step (SGDR, Loshchilov & Hutter 2017;
    the GPT-3/Chinchilla schedule with a floor)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, opt: OptimizerSection, device_type: str) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (norm weights, biases), as in GPT-2/nanoGPT.

    The fused kernel on CUDA and on CPUs (torch >= 2.4 has a fused CPU AdamW: measured 1.8 ms per step for the
    3M-parameter llama-tiny vs 10 ms for foreach and 6 ms for the per-tensor loop); multi-tensor (foreach)
    where no fused kernel exists."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    common = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps}
    if device_type in ("cuda", "cpu"):
        try:
            return torch.optim.AdamW(groups, fused=True, **common)
        except RuntimeError as e:  # an older torch or a dtype without a fused kernel
            log.info("fused AdamW unavailable (%s); using foreach", str(e).splitlines()[0])
    return torch.optim.AdamW(groups, foreach=True, **common)


class DevicePrefetcher:
    """Yields device micro-batches, copying batch k+1 while batch k computes (seed: "Optimizing I/O").

    On CUDA the host tensors are pinned so `non_blocking=True` is a real asynchronous copy; on a CPU device the
    batch is used where it is.
    """

    def __init__(self, batches: Iterator[Batch], device: torch.device) -> None:
        self._src, self._device = batches, device
        self._cuda = device.type == "cuda"
        self._next = self._load()

    def _load(self) -> Batch | None:
        b = next(self._src, None)
        if b is None or not self._cuda:
            return b
        return Batch(
            inputs=b.inputs.pin_memory().to(self._device, non_blocking=True),
            targets=b.targets.pin_memory().to(self._device, non_blocking=True),
        )

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Batch:
        cur = self._next
        if cur is None:
            raise StopIteration
        self._next = self._load()
        return cur


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    under_torchrun: bool

    @classmethod
    def from_environ(cls) -> RankEnv:
        e = os.environ
        return cls(int(e.get("RANK", 0)), int(e.get("WORLD_SIZE", 1)), int(e.get("LOCAL_RANK", 0)), "RANK" in e)


def max_rss_bytes() -> int:
    """This process's peak resident memory so far, as the OS counts it (Linux ru_maxrss is in KiB)."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def init_distributed(env: RankEnv, backend: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if env.under_torchrun:
        # On CUDA also a gloo backend for CPU tensors (the stop-flag agreement must not sync the GPU).
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if backend == "nccl" else "gloo")
    else:  # one plain process: a world of one, no rendezvous needed
        dist.init_process_group(
            backend="cuda:nccl,cpu:gloo" if backend == "nccl" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )


def plan_source(plan: Plan) -> tuple[Any, str]:
    """The plan's data (blocks, description). Its tokens must be below the model's real vocabulary, not the padded
    one: the padded rows are never a target (the loss is over the real vocabulary)."""
    t = plan.training
    expected = expected_tokenizers(plan.data, plan.model.weights)
    return build_source(plan.data, t.seq_len, t.seed, base_spec(plan).vocab_size, expected)


def plan_val_source(plan: Plan) -> tuple[Any, str] | None:
    """The validation blocks (in order) and their description, or None without data.val."""
    expected = expected_tokenizers(plan.data, plan.model.weights)
    return build_val_source(plan.data, plan.training.seq_len, base_spec(plan).vocab_size, expected)


def run(plan: Plan) -> dict[str, Any]:
    """Train per the plan on this rank. Returns a summary (last step, losses seen, why it stopped)."""
    import torch
    import torch.distributed as dist

    env = RankEnv.from_environ()
    # Installed first: a preemption signal during start-up then stops the run at its first step boundary.
    stop = StopSignal()
    stop.install()
    choice = select_device(torch.cuda.is_available(), env.local_rank)
    device = torch.device(choice.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # fp32 matmuls on TF32 tensor cores: what the GPU catalog's fp32 peak (and so MFU) assumes.
        torch.set_float32_matmul_precision("high")
    t = plan.training
    attn_impl, attn_why = select_attention(t.attention, device.type == "cuda", flash_attn_importable())
    loss_impl, loss_why = select_loss(t.loss_chunk_tokens, device.type == "cuda", liger_importable())
    if plan.training.precision in ("bf16-mixed", "bf16") and device.type == "cpu":
        log.info("precision %s on a CPU works but is slower than fp32 without AMX", t.precision)
    check_installed(plan.logging)
    init_distributed(env, choice.backend)
    is_main = env.rank == 0
    finished = False
    try:
        mesh = build_mesh(plan, device.type, env.world_size)
        dims = plan.parallel_dims  # the data-parallel rank and size, replicas: all from the degrees
        spec = model_spec_for(plan)
        blocks, data_desc = plan_source(plan)
        val = plan_val_source(plan)
        weights = None
        if plan.model.weights:
            from llmctl.engine.materialize import WeightFiles

            weights = WeightFiles.scan(plan.model.weights)  # fails fast, before anything is built
        ckpt = None
        found = None
        if plan.checkpoint.dir:
            ckpt = Checkpointer(Path(plan.checkpoint.dir), plan.checkpoint.keep_last, env.rank, plan_to_yaml(plan))
            ckpt.clean_partial()
            dist.barrier()
            found = latest_checkpoint(ckpt.root)
        model = build_meta_model(plan, attn_impl)
        built = str(getattr(model.config, "_attn_implementation", None) or attn_impl)
        if built != attn_impl:  # the model class has no such path (Gemma 2, gpt-oss: no SDPA): fit_attention's pick
            attn_why, attn_impl = f"{model.__class__.__name__} has no {attn_impl} path", built
        rss_base = max_rss_bytes()  # imports done, nothing allocated for the model yet
        fsdp = parallelize(model, plan, mesh)
        made = materialize(model, plan, device, weights=weights, resuming=found is not None)
        # The loss is over the real vocabulary: the rows padded onto the LM head (model.pad_vocab_multiple) are never
        # a target and take no probability mass, so the loss equals the unpadded model's (and their gradient is 0).
        vocab = base_spec(plan).vocab_size
        if loss_impl != "whole":
            install_loss_forward(model, loss_impl, vocab, t.loss_chunk_tokens)
        if found is not None and weights is not None:
            log.info("resuming from %s: its weights win over model.weights (%s)", found[1], plan.model.weights)
        optimizer = build_optimizer(model, plan.optimizer, device.type)
        total = plan.total_steps
        o = plan.optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total, o.warmup_steps, o.min_lr_ratio)
        )
        data = RankData(blocks, t.micro_batch_size, t.grad_accum_steps, dims.dp_rank(env.rank), dims.dp)

        start = 0
        run_id = new_run_id()  # a run from step 0 is a new TensorBoard/W&B run; a resumed one continues its own
        if ckpt is not None and found is not None:
            state = ckpt.load(found[1], model, optimizer, scheduler)
            start = int(state["step"])
            run_id = str(state.get("run_id") or run_id)
            if state.get("samples_consumed") != data.samples_consumed(start):
                raise SpecError(
                    f"checkpoint {found[1]} was made with a different global batch "
                    f"(data position {state.get('samples_consumed')} at step {start})",
                    hint="resume with the plan it was saved with, or use a new checkpoint.dir",
                )
        rss_setup = max_rss_bytes()
        # Every rank's (before model, peak) resident memory: the start event reports the worst rank.
        rss_all: list[Any] = [None] * env.world_size
        dist.all_gather_object(rss_all, (rss_base, rss_setup))

        peak = None
        if device.type == "cuda" and plan.hardware.gpu:
            from llmctl.spec.hardware import resolve_gpu

            peak = resolve_gpu(plan.hardware.gpu).peak_tflops(param_dtype_name(t.precision))
        tput = ThroughputModel.for_run(
            spec,
            t.seq_len,
            plan.tokens_per_step,
            env.world_size,
            t.activation_checkpointing,
            peak,
            "eager" if attn_impl == "eager" else "sdpa",
            loss_impl == "chunked",
        )
        evaluator = None
        if val is not None:
            evaluator = Evaluator(
                val[0],
                t.micro_batch_size,
                t.grad_accum_steps,
                dims.dp_rank(env.rank),
                dims.dp,
                plan.logging.eval_batches,
            )
        metrics = None
        if is_main:
            sinks = open_sinks(plan, run_id, start, plan_to_yaml(plan))
            metrics = MetricsLog(Path(plan.logging.dir) / "metrics.jsonl", total, sinks=sinks)

        def emit(record: dict[str, Any]) -> None:
            if metrics is not None:
                metrics.event(record)

        emit(
            {
                "event": "start",
                "step": start,
                "total_steps": total,
                "world_size": env.world_size,
                "mesh": list(mesh.shape),
                "mesh_dims": list(mesh.mesh_dim_names or ()),
                "fsdp2": fsdp,
                "device": str(device),
                "backend": choice.backend,
                "attention": attn_impl,
                "checkpointing": t.activation_checkpointing,
                "loss": loss_impl,
                "loss_chunk_tokens": t.loss_chunk_tokens,
                "precision": t.precision,
                "params": spec.params,
                "vocab_size": spec.vocab_size,
                "tokens_per_step": plan.tokens_per_step,
                "model_flops_per_token": tput.model_flops_per_token,
                "peak_tflops": peak,
                "data": data_desc,
                "val": None if val is None else f"{val[1]}; {evaluator.num_sequences if evaluator else 0} sequences",
                "run_id": run_id,
                "init": made.source,
                "rss_before_model_bytes": rss_base,
                "rss_peak_setup_bytes": rss_setup,
                "rss_per_rank_bytes": [list(r) for r in rss_all],
                "message": f"{'resuming at' if start else 'starting at'} step {start}/{total}: {spec.params:,} params, "
                f"attention {attn_impl} ({attn_why}), loss {loss_impl} ({loss_why}), mesh {tuple(mesh.shape)} "
                f"{mesh.mesh_dim_names}{'' if fsdp else ' (one rank: no FSDP)'}, {choice.backend}, "
                f"{data_desc}; {'validation: ' + val[1] + '; ' if val else ''}{made.source}",
            }
        )

        acc = t.grad_accum_steps
        replicas = dims.dp_replicate if fsdp else 1
        micro = (b for s in range(start, total) for b in data.micro_batches(s))
        batches = DevicePrefetcher(micro, device)
        losses: dict[int, float] = {}
        reason = "done"
        last_t, last_step = time.perf_counter(), start
        step = start
        # Measured vs planned, once, on the first logged window that starts check_after_steps past the (re)start.
        lg = plan.logging
        check_pending = lg.check_after_steps > 0
        data_wait, frames = 0.0, compiled_frames()
        while step < total:
            loss_sum = torch.zeros((), device=device)
            for m in range(acc):
                if acc > 1 and replicas > 1:
                    # HSDP / no_shard: reduce-scatter inside the shard group every micro-batch (gradients stay
                    # sharded), all-reduce across replicas only on the last one. FULL shard reduce-scatters every
                    # micro-batch: FSDP2's no_sync (set_requires_gradient_sync(False)) would keep every layer's
                    # unsharded gradients alive across micro-batches (+4 bytes/param per GPU, unsharded), which
                    # neither the memory model nor the planner assumes.
                    model.set_requires_all_reduce(m == acc - 1)
                t_wait = time.perf_counter()
                b = next(batches)
                data_wait += time.perf_counter() - t_wait
                if loss_impl == "whole":
                    loss = whole_loss(model, b.inputs, b.targets, vocab)
                else:
                    loss = model(input_ids=b.inputs, labels=b.targets)
                (loss / acc).backward()
                loss_sum += loss.detach()
            grad_norm = None
            if t.grad_clip is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
            optimizer.step()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % plan.logging.interval_steps == 0 or step == total:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                loss_val = loss_sum.item() / (acc * env.world_size)  # a host sync, on logging steps only
                gn = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                now = time.perf_counter()
                losses[step] = loss_val
                rec = {
                    "event": "step",
                    "step": step,
                    "loss": loss_val,
                    "lr": lr,
                    "grad_norm": float(gn) if gn is not None else None,
                    **tput.measure((now - last_t) / (step - last_step)),
                    **peak_memory(device.type),
                }
                emit(with_predictions(rec, plan.predicted))
                if check_pending and last_step >= start + lg.check_after_steps:
                    check_pending = False
                    clues = Clues(
                        device.type, plan.hardware.gpu, data_wait / (now - last_t), compiled_frames() - frames
                    )
                    verdict = judge(step, rec, plan.predicted, clues, lg.check_slower, lg.check_memory)
                    emit(verdict.record)  # printed as [plan_check] when off: the warning, once
                last_t, last_step = now, step
                data_wait, frames = 0.0, compiled_frames()

            every = plan.logging.eval_interval_steps
            if evaluator is not None and ((every and step % every == 0) or step == total):
                res = evaluator.run(model, loss_impl, vocab, device)
                emit(
                    {
                        "event": "eval",
                        "step": step,
                        **res,
                        "message": f"step {step}: validation loss {res['val_loss']:.4f} (perplexity "
                        f"{res['val_ppl']:.2f}) on {res['val_sequences']} sequences, {res['val_tokens']:,} tokens, "
                        f"{res['seconds']:.1f} s",
                    }
                )
                last_t = time.perf_counter()  # keep evaluation time out of the next step-time measurement
                data_wait, frames = 0.0, compiled_frames()

            stopping = stop.agreed()
            if ckpt is not None and (stopping or step % plan.checkpoint.interval_steps == 0 or step == total):
                t0 = time.perf_counter()
                path = ckpt.save(
                    step,
                    model,
                    optimizer,
                    scheduler,
                    {
                        "step": step,
                        "samples_consumed": data.samples_consumed(step),
                        "world_size": env.world_size,
                        "seed": t.seed,
                        "run_id": run_id,
                    },
                )
                emit(
                    {
                        "event": "checkpoint",
                        "step": step,
                        "path": str(path),
                        "seconds": time.perf_counter() - t0,
                        "message": f"saved {path} at step {step}",
                    }
                )
                last_t = time.perf_counter()  # keep save time out of the next step-time measurement
                data_wait, frames = 0.0, compiled_frames()
            if stopping:
                reason = "signal"
                emit(
                    {
                        "event": "stop",
                        "step": step,
                        "reason": "signal",
                        "message": f"stopping at step {step} on a preemption signal"
                        + (
                            " (checkpoint saved; start again to resume)"
                            if ckpt
                            else " (no checkpoint.dir: progress is lost)"
                        ),
                    }
                )
                break
        emit({"event": "end", "step": step, "reason": reason, "message": f"finished at step {step}/{total}"})
        if metrics is not None:
            metrics.close()
        finished = True
        return {"step": step, "losses": losses, "reason": reason}
    finally:
        if dist.is_initialized() and finished:
            # All ranks leave together: tearing gloo down while a peer's last collective (or a sub-group of the
            # 2-D mesh) is still in flight can abort a rank ("terminate called without an active exception",
            # seen once on a 2x2 HYBRID run). On an error path neither barrier nor destroy: a peer may never
            # arrive, and destroy can then deadlock (torchtitan#1342 does the same); the process exits anyway.
            dist.barrier()
            dist.destroy_process_group()
