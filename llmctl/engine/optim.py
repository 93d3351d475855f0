"""The optimizer and its learning-rate schedule: AdamW (fused where a kernel exists; with `optimizer.states`, bf16 or
fp32 moments of their own, or torchao's 8-bit AdamW: llmctl.engine.adamw_states), warm-up then cosine decay."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from llmctl.engine import ao
from llmctl.errors import InputError
from llmctl.spec.planfile import OptimizerSection

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


def check_installed(opt: OptimizerSection) -> None:
    """Before anything is built: 8-bit states need torchao (one line naming the extra), as loggers.check_installed
    does for the loggers; build_optimizer comes only after the model is built and materialized."""
    import importlib.util

    if opt.states == "8bit" and importlib.util.find_spec("torchao") is None:
        raise InputError("optimizer.states 8bit needs torchao, which is not installed", hint=ao.HINT)


BF16_MOMENT_STEP = 2**-8
"""Half of bf16's spacing is 2^-9 to 2^-8 of a value: a second moment that decays by (1 - beta2) a step, less than
that, is rounded back to where it was (llmctl.spec.optimizer_states: the bf16 caveat)."""


def _mixes_dtensors(params: list) -> bool:
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in params}
    return len(kinds) > 1


def build_optimizer(model: torch.nn.Module, opt: OptimizerSection, device_type: str) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (norm weights, biases), as in GPT-2/nanoGPT.

    The moments in the parameters' dtype (`optimizer.states` auto, or the parameters' own dtype): the fused kernel
    on CUDA and on CPUs (torch >= 2.4 has a fused CPU AdamW: measured 1.8 ms per step for the 3M-parameter
    llama-tiny vs 10 ms for foreach and 6 ms for the per-tensor loop); multi-tensor (foreach) where no fused kernel
    exists. bf16 or fp32 moments over parameters of another dtype: MomentsAdamW; 8bit: torchao's AdamW8bit."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    common = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps}
    if opt.states == "8bit":
        from llmctl.engine.adamw_states import adamw_8bit

        return adamw_8bit(groups, **common)
    moments = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(opt.states)
    if moments is not None and any(p.dtype != moments for p in params):
        from llmctl.engine.adamw_states import MomentsAdamW

        if moments == torch.bfloat16 and 1 - opt.betas[1] < BF16_MOMENT_STEP:
            log.warning(
                "optimizer.states bf16 with beta2 %g: exp_avg_sq's per-step decay (%.2g) is under bf16's rounding "
                "step, so it will not decrease; use beta2 <= 0.99 or fp32 states",
                opt.betas[1],
                1 - opt.betas[1],
            )
        return MomentsAdamW(groups, moments_dtype=moments, **common)
    if _mixes_dtensors(params):
        # Tensor parallelism without FSDP (dp 1) leaves the parameters its plan keeps whole as plain tensors (a
        # mixture-of-experts block, OLMo 2's q/k norms, MLA's latent projections) next to DTensors: the fused and
        # multi-tensor kernels refuse the mix, the per-tensor loop does not. (FSDP2 makes every parameter a DTensor.)
        log.info("AdamW per tensor: the parameters mix DTensors and plain tensors (tp without FSDP)")
        return torch.optim.AdamW(groups, foreach=False, fused=False, **common)
    if device_type in ("cuda", "cpu"):
        try:
            return torch.optim.AdamW(groups, fused=True, **common)
        except RuntimeError as e:  # an older torch or a dtype without a fused kernel
            log.info("fused AdamW unavailable (%s); using foreach", str(e).splitlines()[0])
    return torch.optim.AdamW(groups, foreach=True, **common)
