"""The optimizer step's gradient handling: the global gradient norm, clipping, and fp16's dynamic loss scaling.

fp16 (max 65504, smallest normal 6.1e-5) loses the small gradients of a large model to underflow: the loss is
multiplied by a scale S before backward so they survive, and the gradients are divided by S before the optimizer
sees them (Micikevicius et al. 2018, "Mixed Precision Training", https://arxiv.org/abs/1710.03740). S is dynamic, as
in `torch.amp.GradScaler` (torch/amp/grad_scaler.py, whose defaults these are): a step whose gradients hold an inf
or NaN is skipped (no optimizer update) and S is multiplied by 0.5; after 2000 steps in a row without one, by 2.

Under FSDP2 the gradients are shards: the check is the global norm of the *scaled* gradients (one reduction over
every mesh, which any clipping computes anyway) being finite, and a MAX all-reduce of that verdict over the world, so
every rank skips the same steps even if their shards disagree. Gradients are reduced in fp32 (the policy's
reduce dtype), so the reduction itself does not overflow where the fp16 backward did not. Clipping then applies to
the unscaled gradients: the unscale and the clip are one multiply, by (1/S) x min(1, max_norm / (norm/S)).

The scaler's state (scale, steps since the last overflow, skipped steps) is the same on every rank and goes into
every checkpoint's trainer state, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger("llmctl.engine")

OVERFLOW_TEST_ENV = "LLMCTL_ENGINE_TEST_OVERFLOW"
"""Tests only: "STEP:RANK" multiplies that rank's first micro-batch loss of that step (1-based) by 1e30, so its
fp16 backward overflows there and nowhere else."""


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm (fp32) of gradients that are plain tensors or DTensors on one or several meshes (data x tp
    and data only under TP): each mesh's norms stacked and made whole once (`full_tensor`: the reduction over that
    mesh), the meshes summed in squares."""
    import torch
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = []
    for group in groups.values():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(group, 2.0)), 2.0)
        if isinstance(norm, DTensor):
            mesh_device = norm.device_mesh.device_type
            if norm.to_local().device.type != mesh_device:  # CPU offload: host gradients, collectives on the GPU
                norm = DTensor.from_local(norm.to_local().to(mesh_device), norm.device_mesh, norm.placements)
            norm = norm.full_tensor()
        squares.append(norm.float().pow(2))
    if not squares:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack([q.to(squares[0].device) for q in squares]).sum().sqrt()


def scale_grads_(grads: list[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every gradient (its local shard, for a DTensor) by `factor` in place."""
    import torch
    from torch.distributed.tensor import DTensor

    if not grads:
        return
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    with torch.no_grad():
        if isinstance(factor, torch.Tensor):
            factor = factor.to(local[0].device)
        torch._foreach_mul_(local, factor)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)): torch.nn.utils.clip_grad_norm_'s factor."""
    import torch

    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@dataclass
class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's rule and defaults (init 2**16, x2 after 2000 clean steps, x0.5
    on an overflow)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    clean_steps: int = 0
    """Steps since the last overflow (GradScaler's growth tracker)."""
    skipped_steps: int = 0
    """Steps skipped for an overflow since the run began (carried over a resume)."""

    def found_overflow(self, scaled_norm: torch.Tensor) -> bool:
        """Whether any rank's scaled gradients hold an inf or NaN: the norm's verdict, agreed by a MAX all-reduce
        over the world (one tiny collective and one host sync per step, as GradScaler's found_inf read)."""
        import torch
        import torch.distributed as dist

        bad = torch.logical_not(torch.isfinite(scaled_norm)).to(torch.float32).reshape(1)
        if dist.is_available() and dist.is_initialized():
            # gloo reduces host tensors, NCCL device ones (the norm is on the host under CPU offload)
            bad = (
                bad.cpu() if dist.get_backend() == "gloo" else bad.to(torch.device("cuda", torch.cuda.current_device()))
            )
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow (and count the skip), else grow after growth_interval clean steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            if math.isfinite(grown):  # GradScaler keeps the scale where growing would overflow fp32
                self.scale = grown
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in self.__dataclass_fields__:
                setattr(self, k, type(getattr(self, k))(v))


def overflow_injection(step: int, rank: int, micro_batch: int) -> float:
    """1e30 on the step and rank OVERFLOW_TEST_ENV names (its first micro-batch), else 1 (tests only)."""
    spec = os.environ.get(OVERFLOW_TEST_ENV)
    if not spec or micro_batch != 0:
        return 1.0
    at_step, _, at_rank = spec.partition(":")
    return 1e30 if int(at_step) == step and int(at_rank or 0) == rank else 1.0


class GradStep:
    """What happens to the accumulated gradients of one step before the optimizer: the global norm (when clipping
    or scaling needs it), the loss scaler's overflow check and skip, the unscale and the clip as one multiply."""

    def __init__(
        self,
        clip: float | None,
        scaler: LossScaler | None,
        across: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.clip, self.scaler = clip, scaler
        self.across = across
        """The norm over what this rank's gradients are a part of beyond its meshes (pipeline stages: the pp
        group's sum of squares); None: this rank's meshes are the whole model."""

    @property
    def loss_multiplier(self) -> float:
        """What each micro-batch's loss is multiplied by before backward (the loss scale; 1 without one)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> tuple[bool, torch.Tensor | None]:
        """(whether the optimizer should step, the global norm of the unscaled gradients before clipping; None when
        neither clipping nor scaling computed one, or on a skipped step). On a skipped step the gradients are left for
        the caller to zero."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.clip is None and self.scaler is None:
            return True, None
        norm = grad_norm(grads)
        if self.across is not None:
            norm = self.across(norm)
        factor: torch.Tensor | float = 1.0
        if self.scaler is not None:
            if self.scaler.found_overflow(norm):
                log.warning("fp16 gradients overflowed at loss scale %g: step skipped, scale halved", self.scaler.scale)
                self.scaler.update(overflow=True)
                return False, None
            inv = 1.0 / self.scaler.scale
            norm = norm * inv
            factor = inv
            self.scaler.update(overflow=False)
        if self.clip is not None:
            factor = clip_coefficient(norm, self.clip) * factor
        if not (isinstance(factor, float) and factor == 1.0):
            scale_grads_(grads, factor)
        return True, norm
