"""One rank's training, in the shape of torchtitan's `Trainer`: setup, `train_step`, evaluation, the loop.

- `Trainer(plan, env, stop)`: what needs no process group yet: the device, the attention and loss kernels, the
  installed loggers (a bad choice fails here, before any rendezvous).
- `setup()`: the mesh, the data, the model (meta device -> AC -> compile -> FSDP2 -> this rank's shard), AdamW and
  its schedule, the checkpoint restore, the evaluator and metrics.jsonl; logs the `start` event.
- `train_step(batches)`: one optimizer step: `forward_backward` per micro-batch, gradient clipping, AdamW, the
  LR step.
- `evaluate()`: the validation loss (llmctl.engine.evaluate).
- `train()`: the loop: steps, the step records and the measured-vs-plan check, evaluation and checkpoint
  intervals, the stop signal.

Per optimizer step: `grad_accum_steps` micro-batches; gradients are reduce-scattered inside the shard group every
micro-batch (they stay sharded) and all-reduced across replicas (HYBRID, no_shard) only on the last one
(`set_requires_all_reduce`); the loss kept on the device (no host sync in the micro-batch loop), gradient clipping,
AdamW (fused kernel on CUDA and CPU), warm-up + cosine LR. Host syncs happen only at step boundaries: the
stop-signal agreement (a CPU all-reduce) and, on logging steps, the loss.

Under pipeline parallelism (pp > 1, llmctl.engine.pipeline) `self.model` is this rank's stages and a step is
grad_accum_steps / pipeline_microbatches schedule runs; the loss comes from the last stage's ranks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmctl.engine import float8
from llmctl.engine.checkpoint import Checkpointer, StopSignal
from llmctl.engine.context_parallel import SequenceSplit, cp_mesh, whole
from llmctl.engine.cpu_bf16 import half_precision_line
from llmctl.engine.data import Batch, RankData, build_source, build_val_source, expected_tokenizers, one_row
from llmctl.engine.evaluate import Evaluator
from llmctl.engine.experts import aux_loss, load_fields
from llmctl.engine.kernel_profile import StepProfiler
from llmctl.engine.livecheck import Clues, compiled_frames, judge
from llmctl.engine.loggers import RunRecord, check_installed, new_run_id, open_sinks
from llmctl.engine.lora import check_installed as check_lora_installed
from llmctl.engine.lora import trainable_params
from llmctl.engine.loss import install_loss_forward, liger_importable, local_value, model_loss, select_loss
from llmctl.engine.metrics import MetricsLog, PhasePeaks, ThroughputModel, peak_memory, with_predictions
from llmctl.engine.model import (
    Values,
    base_spec,
    build_meta_model,
    flash_attn_importable,
    materialize,
    model_spec_for,
    select_attention,
    select_device,
)
from llmctl.engine.optim import build_optimizer, lr_factor
from llmctl.engine.optim import check_installed as check_optimizer_installed
from llmctl.engine.parallelize import build_mesh, check_world, needs_fsdp, parallelize
from llmctl.engine.resume import plan_fingerprint
from llmctl.engine.scaler import GradStep, LossScaler, overflow_injection
from llmctl.engine.sdpa import for_run as sdpa_for_run
from llmctl.engine.watchdog import Watchdog
from llmctl.errors import InputError, SpecError
from llmctl.spec.attention import Attention
from llmctl.spec.planfile import Plan, plan_to_yaml

if TYPE_CHECKING:
    import torch

    from llmctl.engine.pipeline import Pipeline
    from llmctl.spec.planfile import DataSection
    from llmctl.spec.setup import TrainSetup

log = logging.getLogger("llmctl.engine")

GRADS_PROBE_ENV = "LLMCTL_ENGINE_TEST_GRADS"
"""Tests only: when set, each rank writes its parameters' whole gradients of the run's first step under logging.dir
(grads/grads-rank<R>.pt)."""


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
        pos = None if b.positions is None else b.positions.pin_memory().to(self._device, non_blocking=True)
        return Batch(
            inputs=b.inputs.pin_memory().to(self._device, non_blocking=True),
            targets=b.targets.pin_memory().to(self._device, non_blocking=True),
            positions=pos,
            loss_divisor=b.loss_divisor,
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


def data_source(data: DataSection, weights: str | None, s: TrainSetup, seed: int, vocab: int) -> tuple[Any, str]:
    """The training data (blocks, description) of `s`'s sequence length, shuffled by `seed`. Its tokens must be below
    the model's real vocabulary `vocab`, not the padded one: the padded rows are never a target (the loss is over the
    real vocabulary); a model.weights folder names the tokenizer they were made with."""
    expected = expected_tokenizers(data, weights)
    return build_source(data, s.seq_len, seed, vocab, expected, cp=s.cp)


def val_data_source(data: DataSection, weights: str | None, s: TrainSetup, vocab: int) -> tuple[Any, str] | None:
    """The validation blocks (in order) and their description, or None without data.val."""
    expected = expected_tokenizers(data, weights)
    return build_val_source(data, s.seq_len, vocab, expected, s.cp)


@dataclass
class StepOutput:
    """What one optimizer step leaves for its step record."""

    loss_sum: torch.Tensor
    """The micro-batches' losses summed, still on the device (read on logging steps only: a host sync)."""
    grad_norm: torch.Tensor | None
    """The global gradient norm before clipping (None without training.grad_clip and loss scaling, or skipped)."""
    lr: float
    """The learning rate the step used."""
    skipped: bool = False
    """fp16's loss scaler found an overflow: no optimizer update."""


class Trainer:
    """Trains per the plan on this rank: `Trainer(...)`, then (process group up) `setup()`, then `train()`."""

    def __init__(self, plan: Plan, env: RankEnv, stop: StopSignal) -> None:
        import torch

        self.plan, self.env, self.stop = plan, env, stop
        self.choice = select_device(torch.cuda.is_available(), env.local_rank)
        self.device = torch.device(self.choice.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # fp32 matmuls on TF32 tensor cores: what the GPU catalog's fp32 peak (and so MFU) assumes.
            torch.set_float32_matmul_precision("high")
        self.setup_ = s = plan.setup  # the one training setup (llmctl.spec.setup): degrees, precision, batch, ...
        cuda = self.device.type == "cuda"
        self.phase_peaks = PhasePeaks(cuda)
        self.attn_impl, self.attn_why = select_attention(s.attention, cuda, flash_attn_importable(), s.cp)
        self.loss_impl, self.loss_why = select_loss(s.loss_chunk_tokens, cuda, liger_importable(), s.tp, s.pp)
        if s.precision.compute_dtype != "fp32" and self.device.type == "cpu" and env.rank == 0:
            warn, line = half_precision_line(s.precision.name, s.finetune.method)
            (log.warning if warn else log.info)(line)
        check_installed(plan.logging)
        check_optimizer_installed(plan.optimizer)  # 8-bit states need torchao: one line before anything is built
        check_lora_installed(s.finetune)
        self.metrics: MetricsLog | None = None
        self.watch = Watchdog(plan.logging.dir, env.rank)  # heartbeats and stacks (issue 50)
        self.pipeline: Pipeline | None = None
        """Pipeline parallelism (pp > 1): this rank's stages and their schedule (llmctl.engine.pipeline)."""
        self._grads_probe = os.environ.get(GRADS_PROBE_ENV)
        self.aux: Any = None
        """The MoE auxiliary load-balancing loss (training.moe_aux_loss: llmctl.engine.experts.AuxLoss), or None."""
        self.step = 0
        self._resume_warnings: list[str] = []
        """Damaged checkpoints set aside at the restore (rank 0), logged as `warning` events."""
        self._resume_changes: list[str] = []
        """What the plan changed from the checkpoint's (resumed with --resume-anyway), logged as a `resume` event."""

    # --- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build everything the loop needs, on this rank, in the order that makes resumed runs bit-exact; log the
        `start` event."""
        import torch
        import torch.distributed as dist

        plan, env, t = self.plan, self.env, self.setup_
        check_world(plan.hardware, env.world_size)
        self.mesh = build_mesh(t.dims, self.device.type)
        ring = cp_mesh(self.mesh)  # context parallelism: each micro-batch split over the cp ranks
        self.split = whole if ring is None else SequenceSplit(ring, t.cp_load_balance, t.cp_rotate)
        dims = t.dims  # the data-parallel rank and size, replicas: all from the degrees
        self.spec = model_spec_for(plan.model)
        # The loss is over the real vocabulary: the rows padded onto the LM head (model.pad_vocab_multiple) are never
        # a target and take no probability mass, so the loss equals the unpadded model's (and their gradient is 0).
        self.vocab = base_spec(plan.model).vocab_size
        blocks, self.data_desc = data_source(plan.data, plan.model.weights, t, plan.training.seed, self.vocab)
        self.val = val_data_source(plan.data, plan.model.weights, t, self.vocab)
        weights = None
        if plan.model.weights:
            from llmctl.engine.materialize import WeightFiles

            weights = WeightFiles.scan(plan.model.weights)  # fails fast, before anything is built
        found = self._find_checkpoint()
        rss_base = self._build_model(weights, resuming=found is not None)
        if found is not None and weights is not None and not self.setup_.finetune.adapters:
            log.info("resuming from %s: its weights win over model.weights (%s)", found[1], plan.model.weights)
        self.optimizer = build_optimizer(self.model, plan.optimizer, self.device.type)
        # fp16-mixed: the loss scaled, overflowed steps skipped on every rank (llmctl.engine.scaler)
        self.grad_step = GradStep(
            plan.training.grad_clip,
            LossScaler() if t.precision.loss_scaling else None,
            across=self.pipeline.total_norm if self.pipeline is not None else None,
        )
        total, o = plan.total_steps, plan.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, total, o.warmup_steps, o.min_lr_ratio)
        )
        self.data = RankData(blocks, t.micro_batch_size, t.grad_accum_steps, dims.dp_rank(env.rank), dims.dp)
        self.start, self.run_id = self._restore(found)
        if self.float8_scales is not None and dims.tp_enabled:
            # The first step's float8 weight scales from the whole weight too (as every later step's): without one
            # precomputed, FSDP2's cast reduces the amax over the data-parallel ranks only, each tp rank its shard's.
            self.float8_scales(self.model)
        self.step = self.start
        rss_setup = max_rss_bytes()
        # Every rank's (before model, peak) resident memory: the start event reports the worst rank.
        rss_all: list[Any] = [None] * env.world_size
        dist.all_gather_object(rss_all, (rss_base, rss_setup))

        peak = None
        if self.device.type == "cuda" and plan.hardware.gpu:
            from llmctl.spec.hardware import resolve_gpu

            peak = resolve_gpu(plan.hardware.gpu).peak_tflops(t.precision.compute_dtype)
        self.tput = ThroughputModel.for_run(
            self.spec,
            t.seq_len,
            t.tokens_per_step,
            env.world_size,
            t.checkpointing,
            peak,
            Attention.EAGER if Attention.from_hf(self.attn_impl).keeps_scores else Attention.SDPA,
            self.loss_impl == "chunked",
            t.finetune,
        )
        self.evaluator: Evaluator | None = None
        if self.val is not None:
            self.evaluator = Evaluator(
                self.val[0],
                t.micro_batch_size,
                t.grad_accum_steps,
                dims.dp_rank(env.rank),
                dims.dp,
                plan.logging.eval_batches,
                copies=t.tp,
            )
        # HYBRID / no_shard replicate gradients across this many groups (1 without FSDP: a world of one).
        self.replicas = dims.dp_replicate if self.fsdp else 1
        if env.rank == 0:
            run = RunRecord(plan.name, plan_to_yaml(plan), plan.model_dump(mode="json"))
            sinks = open_sinks(plan.logging, self.run_id, self.start, run)
            self.metrics = MetricsLog(Path(plan.logging.dir) / "metrics.jsonl", total, sinks=sinks)
        self._resume_events()
        # the SDPA kernel the plan priced, asked for first (loop.run trains under its order), and the one SDPA runs
        self.sdpa = sdpa_for_run(self.device, self.attn_impl, self.spec.layers[0].attention, t, self.env.rank == 0)
        self.emit(self._start_record(peak, rss_base, rss_setup, rss_all))

    def _find_checkpoint(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint under checkpoint.dir (partial saves of a killed run removed first), or
        None."""
        import torch.distributed as dist

        plan = self.plan
        self.ckpt: Checkpointer | None = None
        if not plan.checkpoint.dir:
            return None
        base = None
        if self.setup_.finetune.adapters:  # the checkpoints hold the adapters and name the frozen base
            from llmctl.engine.lora import base_identity

            base = base_identity(plan.model, plan.training.seed, self.spec)
        self.ckpt = Checkpointer(
            Path(plan.checkpoint.dir), plan.checkpoint.keep_last, self.env.rank, plan_to_yaml(plan), base
        )
        self.ckpt.clean_partial()
        dist.barrier()
        from llmctl.engine.resume import usable_checkpoint

        found, self._resume_warnings = usable_checkpoint(self.ckpt.root, self.env.rank)
        return found

    def _build_model(self, weights: Any, resuming: bool) -> int:
        """The model on the meta device, then AC -> compile -> FSDP2 (llmctl.engine.parallelize), then this rank's
        shard allocated and filled (random init, model.weights, or left for the checkpoint when resuming), with the
        plan's loss forward. Returns the resident memory before it (imports done, nothing allocated yet)."""
        self.model = build_meta_model(self.spec, self.setup_, self.attn_impl)
        # LoRA: the adapters' parameters (build_meta_model injected them); every parameter trains otherwise
        self.trainable = trainable_params(self.model) if self.setup_.finetune.adapters else None
        built = str(getattr(self.model.config, "_attn_implementation", None) or self.attn_impl)
        if built != self.attn_impl:  # the model class has no such path (Gemma 2, gpt-oss: no SDPA): fit_attention's
            self.attn_why, self.attn_impl = f"{self.model.__class__.__name__} has no {self.attn_impl} path", built
        if self.setup_.dims.cp_enabled:
            from llmctl.engine.context_parallel import install_cpu_ring, use_ring_attention

            use_ring_attention(self.model)
            if self.device.type == "cpu":
                install_cpu_ring()
        # float8: linear layers swapped for torchao's Float8Linear before TP, AC, compile and FSDP2 (torchtitan's order)
        self.float8 = float8.convert(
            self.model,
            self.setup_.precision,
            needs_fsdp(
                self.mesh.size(), self.setup_.precision, self.setup_.levers.offload, self.setup_.finetune.adapters
            ),
        )
        self.float8_scales = float8.scale_precompute(self.float8)
        rss_base = max_rss_bytes()  # imports done, nothing allocated for the model yet
        values = Values(self.plan.training.seed, self.vocab, weights, resuming)
        if self.setup_.dims.pp_enabled:
            self._build_stages(values)
            return rss_base
        self.fsdp = parallelize(self.model, self.spec, self.setup_, self.mesh)
        self.made = materialize(self.model, self.setup_, self.device, values)
        self.aux = aux_loss(self.model) if self.setup_.moe_aux_loss else None
        if self.loss_impl in ("chunked", "liger"):
            install_loss_forward(self.model, self.loss_impl, self.vocab, self.setup_.loss_chunk_tokens)
        return rss_base

    def _build_stages(self, values: Values) -> None:
        """Pipeline parallelism: this pp rank's stages cut from the meta model (llmctl.engine.pipeline), each
        AC -> compile -> FSDP2 and materialized, the schedule over them; `self.model` becomes the stages."""
        from llmctl.engine.pipeline import build_stages, parallelize_stage, split_model, stage_parts

        full, t = self.model, self.setup_
        parts = split_model(full, t, self.mesh["pp"].get_local_rank(), self.mesh)
        self.fsdp = False
        for _, part in parts:
            self.fsdp = parallelize_stage(part, t, self.mesh)
        made = [materialize(part, t, self.device, values) for _, part in parts]
        self.made = made[0]
        self.pipeline = build_stages(parts, t, self.mesh, self.device, self.vocab)
        self.model = stage_parts([m for _, m in parts], full)
        log.info(
            "pipeline: %s, %d micro-batches per run, stages %s of %d on this rank, fsdp2 %s",
            t.pp_schedule,
            t.pipeline_microbatches,
            self.pipeline.stage_ids,
            t.pipeline_stages,
            self.fsdp,
        )

    def _restore(self, found: tuple[int, Path] | None) -> tuple[int, str]:
        """(the step to start at, the run id): 0 and a new id, or what the newest usable checkpoint holds (its
        model, optimizer and scheduler states loaded in place). A checkpoint that fails to load (damaged in a way
        its marker did not show) is set aside and the one before it is loaded (llmctl.engine.resume)."""
        from llmctl.engine.checkpoint_files import DamagedCheckpoint
        from llmctl.engine.resume import damaged_warning, usable_checkpoint

        damage: DamagedCheckpoint | None = None  # the last load that failed (the same on every rank)
        while self.ckpt is not None and found is not None:
            try:
                return self._load_checkpoint(found[1])
            except DamagedCheckpoint as e:
                damage = e
                if self.env.rank == 0:
                    self._resume_warnings.append(damaged_warning(e, found[1]))
                found, more = usable_checkpoint(self.ckpt.root, self.env.rank, below=found[0])
                self._resume_warnings += more
        if damage is not None:
            raise InputError(f"no checkpoint left to resume from: {damage.message}")
        return 0, new_run_id()  # a run from step 0 is a new TensorBoard/W&B run; a resumed one continues its own

    def _load_checkpoint(self, path: Path) -> tuple[int, str]:
        """Load `path` (every rank): the plan's fingerprint checked first (llmctl.engine.resume), then the states."""
        from llmctl.engine.resume import check_fingerprint

        assert self.ckpt is not None
        trainer = self.ckpt.read(path)
        self._resume_changes = check_fingerprint(path, trainer.get("fingerprint"), plan_fingerprint(self.plan))
        state = self.ckpt.load(path, self.model, self.optimizer, self.scheduler, trainer)
        if self._resume_changes:
            self._apply_plan_optimizer()
        start = int(state["step"])
        run_id = str(state.get("run_id") or new_run_id())
        scaler = self.grad_step.scaler
        if scaler is not None and state.get("loss_scaler"):
            scaler.load_state_dict(state["loss_scaler"])  # the scale the run had reached, not the initial one
        elif scaler is not None:
            log.info("%s has no loss scale (saved in another precision): it starts at %g", path, scaler.scale)
        if state.get("samples_consumed") != self.data.samples_consumed(start):
            raise SpecError(
                f"checkpoint {path} was made with a different global batch "
                f"(data position {state.get('samples_consumed')} at step {start})",
                hint="resume with the plan it was saved with, or use a new checkpoint.dir",
            )
        return start, run_id

    def _apply_plan_optimizer(self) -> None:
        """--resume-anyway: the new plan's AdamW values and peak lr over the checkpoint's (the loaded param groups
        and scheduler hold the old ones; the schedule's shape is the new plan's closure already). The groups are
        build_optimizer's: decayed matrices, then vectors without decay."""
        o, groups = self.plan.optimizer, self.optimizer.param_groups
        self.scheduler.base_lrs = [o.lr] * len(groups)
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for g, decay in zip(groups, (o.weight_decay, 0.0), strict=False):
            g.update(lr=o.lr * factor, initial_lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=decay)
        self.scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr (the step record's lr) reads

    def _resume_events(self) -> None:
        """The warnings about damaged checkpoints set aside, and a `resume` event for a --resume-anyway change."""
        for w in self._resume_warnings:
            self.emit({"event": "warning", "step": self.start, "message": w})
        changes = self._resume_changes
        if changes:
            self.emit(
                {
                    "event": "resume",
                    "step": self.start,
                    "changes": changes,
                    "message": f"resuming at step {self.start} under a changed plan (--resume-anyway): "
                    + "; ".join(changes),
                }
            )

    def _start_record(self, peak: float | None, rss_base: int, rss_setup: int, rss_all: list[Any]) -> dict[str, Any]:
        plan, t, spec, mesh = self.plan, self.setup_, self.spec, self.mesh
        val, evaluator, start, total = self.val, self.evaluator, self.start, plan.total_steps
        return {
            "event": "start",
            "step": start,
            "total_steps": total,
            "world_size": self.env.world_size,
            "mesh": list(mesh.shape),
            "mesh_dims": list(mesh.mesh_dim_names or ()),
            "fsdp2": self.fsdp,
            "device": str(self.device),
            "backend": self.choice.backend,
            "attention": self.attn_impl,
            "sdpa": self.sdpa.as_dict(),
            "checkpointing": t.checkpointing,
            "cp": t.cp,
            **self._pp_fields(),
            **({"ep": t.ep, "expert_shard": t.dims.expert_shard} if t.dims.ep_enabled else {}),
            **({"moe_aux_loss_coef": self.aux.coef} if self.aux is not None else {}),
            "loss_mode": self.loss_impl,
            "loss_chunk_tokens": t.loss_chunk_tokens,
            "precision": t.precision.name,
            "float8": float8.describe(self.model, self.float8),
            "offload": t.levers.offload,
            "loss_scale": None if self.grad_step.scaler is None else self.grad_step.scaler.scale,
            "params": spec.params,
            "finetune": t.finetune.label,
            "trainable_params": spec.params if self.trainable is None else self.trainable,
            "vocab_size": spec.vocab_size,
            "tokens_per_step": plan.tokens_per_step,
            "model_flops_per_token": self.tput.model_flops_per_token,
            "peak_tflops": peak,
            "data": self.data_desc,
            "loss_token_fraction": getattr(self.data.blocks, "loss_token_fraction", None),
            "val": None if val is None else f"{val[1]}; {evaluator.num_sequences if evaluator else 0} sequences",
            "run_id": self.run_id,
            "init": self.made.source,
            "rss_before_model_bytes": rss_base,
            "rss_peak_setup_bytes": rss_setup,
            "rss_per_rank_bytes": [list(r) for r in rss_all],
            "message": f"{'resuming at' if start else 'starting at'} step {start}/{total}: {spec.params:,} params{self._lora_words()}, "
            f"attention {self.attn_impl} ({self.attn_why}){self.sdpa.words()}{self._cp_words()}{self._pp_words()}{self._moe_words()}, loss {self.loss_impl} ({self.loss_why}), mesh "
            f"{tuple(mesh.shape)} {mesh.mesh_dim_names}{'' if self.fsdp else ' (one rank: no FSDP)'}, "
            f"{self.choice.backend}, {self.data_desc}; {'validation: ' + val[1] + '; ' if val else ''}"
            f"{self.made.source}",
        }

    def _lora_words(self) -> str:
        ft = self.setup_.finetune
        if self.trainable is None:
            return ""
        share = 100 * self.trainable / max(1, self.spec.params)
        return f" frozen, {ft.method} rank {ft.rank} adapters: {self.trainable:,} trainable ({share:.2f}%)"

    def _cp_words(self) -> str:
        t = self.setup_
        if not t.dims.cp_enabled:
            return ""
        balance = "head-tail load balance" if t.cp_load_balance else "no load balance"
        return f", ring attention over cp {t.cp} ({balance}, {t.cp_rotate} rotation)"

    def _pp_fields(self) -> dict[str, Any]:
        """The start event's pipeline keys (none at pp 1)."""
        t, pipe = self.setup_, self.pipeline
        if pipe is None:
            return {}
        return {
            "pp": t.pp,
            "pp_schedule": str(t.pp_schedule),
            "pp_microbatches": t.pipeline_microbatches,
            "pp_stages": pipe.num_stages,
            "pp_stages_of_rank0": pipe.stage_ids,
        }

    def _moe_words(self) -> str:
        t, spec = self.setup_, self.spec
        if not spec.moe:
            return ""
        where = f"ep {t.ep}: {spec.num_experts // t.ep} of {spec.num_experts} experts per rank" if t.ep > 1 else "ep 1"
        return f", experts {where}" + (f", aux loss x {self.aux.coef:g}" if self.aux is not None else "")

    def _pp_words(self) -> str:
        t = self.setup_
        if self.pipeline is None:
            return ""
        return (
            f", pipeline pp {t.pp} {t.pp_schedule} ({t.pipeline_stages} stages, {t.pipeline_microbatches} "
            f"micro-batches per run)"
        )

    def emit(self, record: dict[str, Any]) -> None:
        """One event to metrics.jsonl and the console (rank 0; the other ranks have no metrics log)."""
        if self.metrics is not None:
            self.metrics.event(record)

    # --- one optimizer step --------------------------------------------------------------------------------------
    def forward_backward(self, batch: Batch, inject: float = 1.0) -> torch.Tensor:
        """One micro-batch: its loss (the mean over its tokens) and the backward of loss / grad_accum_steps (times
        the loss scale under fp16), so the accumulated gradients are the mean over the step's micro-batches.
        Packed data (batch.loss_divisor set): the backward of sum(losses) / loss_divisor, so that the gradient,
        averaged over the dp ranks, is the mean over the step's loss tokens (llmctl.engine.data); it returns
        that share times grad_accum_steps, which log_step's mean over micro-batches and ranks turns into the
        step's mean loss per token."""
        import contextlib

        acc = self.setup_.grad_accum_steps
        div = batch.loss_divisor
        if div is not None and self.attn_impl.startswith("flash"):
            batch = one_row(batch)  # packed documents: flash-attention 2's varlen path needs one row
        with self.split(batch) as b, contextlib.ExitStack() as stack:
            if self.loss_impl == "parallel":  # the loss, and its backward, on the vocabulary shards
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            reduction = "mean" if div is None else "sum"
            loss = model_loss(self.model, self.loss_impl, b.inputs, b.targets, self.vocab, reduction, b.positions)
            if div is not None:
                loss = loss * (acc / div)
            total = loss if self.aux is None else loss + self.aux.take()  # the MoE load-balancing term: not logged
            self.phase_peaks.mark("forward")
            self.watch.beat("backward")
            (total * (self.grad_step.loss_multiplier * inject / acc)).backward()  # inside the split: the ring too
            self.phase_peaks.mark("backward")
        return local_value(loss)

    def train_step(self, batches: Iterator[Batch]) -> StepOutput:
        """One optimizer step over the next `grad_accum_steps` micro-batches of `batches`; advances `self.step`."""
        import torch

        acc = self.setup_.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            loss_sum += self._pipeline_runs(batches)
        for m in range(acc if self.pipeline is None else 0):
            if acc > 1 and self.replicas > 1:
                # HSDP / no_shard: reduce-scatter inside the shard group every micro-batch (gradients stay
                # sharded), all-reduce across replicas only on the last one. FULL shard reduce-scatters every
                # micro-batch: FSDP2's no_sync (set_requires_gradient_sync(False)) would keep every layer's
                # unsharded gradients alive across micro-batches (+4 bytes/param per GPU, unsharded), which
                # neither the memory model nor the planner assumes.
                self.model.set_requires_all_reduce(m == acc - 1)
            t_wait = time.perf_counter()
            if m == 0:
                self.watch.data(self.step, lambda: self.stop.received is not None)
            b = next(batches)
            self.watch.beat("forward")
            self._data_wait += time.perf_counter() - t_wait
            inject = overflow_injection(self.step + 1, self.env.rank, m) if self.grad_step.scaler else 1.0
            loss = self.forward_backward(b, inject)
            loss_sum += loss.detach()
        if self._grads_probe and self.step == self.start:
            self._write_grads(Path(self.plan.logging.dir) / "grads")
        self.watch.beat("optimizer")
        stepping, grad_norm = self.grad_step(self.model.parameters())
        if stepping:
            self.optimizer.step()
            if self.float8_scales is not None:  # float8 weights all-gathered by FSDP2: next step's scales, at once
                self.float8_scales(self.model)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()  # a skipped (overflowed) step still consumed its data and its place in the schedule
        self.optimizer.zero_grad(set_to_none=True)
        self.phase_peaks.mark("optimizer")
        self.step += 1
        return StepOutput(loss_sum, grad_norm, lr, skipped=not stepping)

    def _pipeline_runs(self, batches: Iterator[Batch]) -> torch.Tensor:
        """A step's grad_accum_steps micro-batches through the pipeline, pipeline_microbatches per schedule run;
        the sum of their losses on the last stage's ranks (0 elsewhere)."""
        import torch

        assert self.pipeline is not None
        t = self.setup_
        total = torch.zeros((), device=self.device)
        for run in range(t.grad_accum_steps // t.pipeline_microbatches):
            t_wait = time.perf_counter()
            if run == 0:
                self.watch.data(self.step, lambda: self.stop.received is not None)
            group = [next(batches) for _ in range(t.pipeline_microbatches)]
            self.watch.beat("forward")  # a schedule run: forwards and backwards interleaved
            self._data_wait += time.perf_counter() - t_wait
            total += self.pipeline.run(group, self.grad_step.loss_multiplier, self.device, self.split)
        self.phase_peaks.mark("backward")
        return total

    def _write_grads(self, folder: Path) -> None:
        """Tests only (GRADS_PROBE_ENV): every parameter's whole gradient of the run's first step, before clipping,
        as `folder`/grads-rank<R>.pt {Hugging Face name: tensor} (each rank its stages' parameters)."""
        import torch

        from llmctl.engine.materialize import clean_name

        named = (
            [(n, p) for part in self.model for n, p in part.named_parameters()]
            if self.pipeline is not None
            else list(self.model.named_parameters())
        )
        out = {}
        for n, p in named:
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                out[clean_name(n)] = g.detach().float().cpu()
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(out, folder / f"grads-rank{self.env.rank}.pt")

    # --- evaluation and checkpoints ------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any] | None:
        """The validation loss now (every rank runs it: FSDP's collectives), logged as an `eval` event; None without
        data.val."""
        if self.evaluator is None:
            return None
        res = self.evaluator.run(self.model, self.loss_impl, self.vocab, self.device, self.split, self.pipeline)
        step = self.step
        self.emit(
            {
                "event": "eval",
                "step": step,
                **res,
                "message": f"step {step}: validation loss {res['val_loss']:.4f} (perplexity "
                f"{res['val_ppl']:.2f}) on {res['val_sequences']} sequences, {res['val_tokens']:,} tokens, "
                f"{res['seconds']:.1f} s",
            }
        )
        return res

    def save_checkpoint(self) -> Path | None:
        """Model, optimizer, scheduler and trainer state at this step (llmctl.engine.checkpoint); None without
        checkpoint.dir."""
        if self.ckpt is None:
            return None
        t0 = time.perf_counter()
        step = self.step
        path = self.ckpt.save(
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            {
                "step": step,
                "samples_consumed": self.data.samples_consumed(step),
                "world_size": self.env.world_size,
                "seed": self.plan.training.seed,
                "run_id": self.run_id,
                "fingerprint": plan_fingerprint(self.plan),
                **({"loss_scaler": sc.state_dict()} if (sc := self.grad_step.scaler) is not None else {}),
            },
        )
        self.emit(
            {
                "event": "checkpoint",
                "step": step,
                "path": str(path),
                "seconds": time.perf_counter() - t0,
                "message": f"saved {path} at step {step}",
            }
        )
        return path

    # --- the loop ------------------------------------------------------------------------------------------------
    def _new_window(self, now: float) -> None:
        """Start a new measurement window at `now`: step time, data wait and compiled frames count from here."""
        self._window_t = now
        self._data_wait, self._frames = 0.0, compiled_frames()

    def _scaler_fields(self, out: StepOutput) -> dict[str, Any]:
        """fp16's loss scale (for the next step), the steps skipped so far, and whether this one was."""
        sc = self.grad_step.scaler
        if sc is None:
            return {}
        return {"loss_scale": sc.scale, "skipped_steps": sc.skipped_steps, "skipped": out.skipped}

    def log_step(self, out: StepOutput) -> float:
        """The `step` record of a logging step (the loss averaged over ranks and micro-batches: a host sync), and
        once, the measured-vs-plan check. Returns the loss."""
        import torch.distributed as dist

        plan, step, lg = self.plan, self.step, self.plan.logging
        dist.all_reduce(out.loss_sum, op=dist.ReduceOp.SUM)
        # The loss is on the last pipeline stage's ranks alone (every rank at pp 1): their mean.
        loss = out.loss_sum.item() / (self.setup_.grad_accum_steps * (self.env.world_size // self.setup_.pp))
        gn = out.grad_norm.full_tensor() if hasattr(out.grad_norm, "full_tensor") else out.grad_norm
        now = time.perf_counter()
        rec = {
            "event": "step",
            "step": step,
            "loss": loss,
            "lr": out.lr,
            "grad_norm": float(gn) if gn is not None else None,
            **self._scaler_fields(out),
            **self.data.step_fields(step - 1),
            **self.tput.measure((now - self._window_t) / (step - self._window_step)),
            **peak_memory(self.device.type, self.phase_peaks),
            **load_fields(self.model, step - self._window_step, whole_world=self.setup_.pp == 1),
        }
        self.emit(with_predictions(rec, plan.predicted))
        # Measured vs planned, once, on the first logged window that starts check_after_steps past the (re)start.
        if self._check_pending and self._window_step >= self.start + lg.check_after_steps:
            self._check_pending = False
            clues = Clues(
                self.device.type,
                plan.hardware.gpu,
                self._data_wait / (now - self._window_t),
                compiled_frames() - self._frames,
            )
            verdict = judge(step, rec, plan.predicted, clues, lg.check_slower, lg.check_memory)
            self.emit(verdict.record)  # printed as [plan_check] when off: the warning, once
        self._window_step = step
        self._new_window(now)
        return loss

    def train(self) -> dict[str, Any]:
        """Steps until the plan's last step or an agreed stop signal. Returns a summary (last step, the losses
        logged, why it stopped)."""
        plan, total = self.plan, self.plan.total_steps
        micro = (b for s in range(self.start, total) for b in self.data.micro_batches(s))
        batches = DevicePrefetcher(micro, self.device)
        losses: dict[int, float] = {}
        reason = "done"
        self._window_step = self.start
        self._check_pending = plan.logging.check_after_steps > 0
        self._new_window(time.perf_counter())
        every_eval = plan.logging.eval_interval_steps
        profiler = StepProfiler.from_env(Path(plan.logging.dir), self.device.type)
        while self.step < total:
            if profiler is not None:
                profiler.before(self.step + 1)
            out = self.train_step(batches)
            step = self.step
            if profiler is not None:
                profiler.after(step, self.env.rank)
            if step % plan.logging.interval_steps == 0 or step == total:
                losses[step] = self.log_step(out)
            if self.evaluator is not None and ((every_eval and step % every_eval == 0) or step == total):
                self.watch.beat("eval", step)
                self.evaluate()
                self._new_window(time.perf_counter())  # keep evaluation time out of the next step-time measurement
            stopping = self.stop.agreed()
            if self.ckpt is not None and (stopping or step % plan.checkpoint.interval_steps == 0 or step == total):
                self.watch.beat("checkpoint", step)
                self.save_checkpoint()
                self._new_window(time.perf_counter())  # keep save time out of the next step-time measurement
            if stopping:
                reason = "signal"
                lost = (
                    " (checkpoint saved; start again to resume)"
                    if self.ckpt
                    else " (no checkpoint.dir: progress is lost)"
                )
                self.emit(
                    {
                        "event": "stop",
                        "step": step,
                        "reason": "signal",
                        "message": f"stopping at step {step} on a preemption signal{lost}",
                    }
                )
                break
        self.watch.beat("done", self.step)
        self.emit(
            {"event": "end", "step": self.step, "reason": reason, "message": f"finished at step {self.step}/{total}"}
        )
        if self.metrics is not None:
            self.metrics.close()
        return {"step": self.step, "losses": losses, "reason": reason}
