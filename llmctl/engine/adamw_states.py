"""AdamW with its moments in a dtype of their own (bf16 over fp32 master weights, or fp32 over pure-bf16 ones), and
torchao's 8-bit AdamW: the optimizers behind `optimizer.states` (llmctl.spec.optimizer_states).

torch's AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype, and torchao's `_AdamW` too (its block size is
infinite, so `_new_buffer` makes a plain `zeros_like(param)`): neither keeps bf16 moments over fp32 parameters.
`MomentsAdamW` does, with torch.optim.AdamW's math (foreach, non-capturable path: decoupled weight decay, lerp for
the first moment, bias corrections per parameter), computed in fp32 and rounded to the moments' dtype when stored.
The fp32 temporaries are bounded: the step runs over pieces of at most `CHUNK_NUMEL` values, so the 4 bytes a
parameter the bf16 moments save are not spent again, all at once, in the step.

Under FSDP2 the parameters, their gradients and the moments are DTensors sharded alike (the moments are made with
the parameter's mesh and placements, as torchao's low-bit optimizers do), so torch.distributed.checkpoint saves and
reshards them like torch's AdamW states.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger("llmctl.engine")

MOMENTS = ("exp_avg", "exp_avg_sq")
CHUNK_NUMEL = 1 << 22
"""Values per foreach call (4M: 16 MiB per fp32 temporary, a few of them live): large enough that the per-call
overhead is nothing next to the memory traffic, small next to any GPU's memory."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def zeros_like_sharded(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of `dtype` shaped, placed and sharded like the parameter (a DTensor with its mesh and placements)."""
    local = torch.zeros_like(_local(p), dtype=dtype)
    if not isinstance(p, DTensor):
        return local
    # Local shards may differ in shape across ranks (dim 0 not divisible): the global shape and stride are given.
    out = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return out.to(p.device)  # from_local moves to the mesh's device type: back where the parameter is (CPU offload)


class MomentsAdamW(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019, alg. 2: torch.optim.AdamW's update) whose exp_avg and exp_avg_sq are stored
    in `moments_dtype` whatever the parameters' dtype; the step's math is fp32."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        moments_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not lr >= 0 or not eps >= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW hyperparameters: lr {lr}, eps {eps}, betas {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.moments_dtype = moments_dtype
        self._stashed: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.register_load_state_dict_pre_hook(MomentsAdamW._stash_moments)
        self.register_load_state_dict_post_hook(MomentsAdamW._restore_moments)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
            pieces: dict[tuple[Any, ...], list[tuple[torch.Tensor, ...]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MomentsAdamW does not take sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # a CPU fp32 scalar, as torch's AdamW keeps it
                    for k in MOMENTS:
                        state[k] = zeros_like_sharded(p, self.moments_dtype)
                state["step"] += 1
                step = float(state["step"])
                # torch.optim.AdamW's scalars: -lr / (1 - beta1^t) and sqrt(1 - beta2^t).
                scalars = (-lr / (1 - beta1**step), (1 - beta2**step) ** 0.5)
                tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                key = (tensors[0].device, *(t.dtype for t in tensors))
                for piece in _pieces(tensors):
                    pieces.setdefault(key, []).append((*piece, *scalars))
            for items in pieces.values():
                for chunk in _chunks(items):
                    _adamw_chunk(chunk, beta1, beta2, eps, 1 - lr * wd)
        return loss

    # torch's Optimizer.load_state_dict casts every floating-point state to its parameter's dtype: fp32 copies of
    # the bf16 moments, for good after a resume. The moments are held aside while it runs and put back in their dtype.
    def _stash_moments(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        param_of = dict(zip(saved, (p for g in self.param_groups for p in g["params"])))
        state: dict[Any, Any] = {}
        for pid, st in state_dict["state"].items():
            state[pid] = {k: v for k, v in st.items() if k not in MOMENTS}
            self._stashed[param_of[pid]] = {k: st[k] for k in MOMENTS if k in st}
        return {**state_dict, "state": state}

    def _restore_moments(self) -> None:
        for p, moments in self._stashed.items():
            for k, v in moments.items():
                self.state[p][k] = v.to(device=p.device, dtype=self.moments_dtype)
        self._stashed = {}


def _pieces(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """(param, grad, exp_avg, exp_avg_sq) cut into flat pieces of at most CHUNK_NUMEL values (views: updates go
    through); whole where one of them is not contiguous."""
    n = tensors[0].numel()
    if n <= CHUNK_NUMEL or not all(t.is_contiguous() for t in tensors):
        return [tuple(tensors)]
    return list(zip(*(t.view(-1).split(CHUNK_NUMEL) for t in tensors)))


def _chunks(items: list[tuple[Any, ...]]) -> Iterable[list[tuple[Any, ...]]]:
    chunk: list[tuple[Any, ...]] = []
    size = 0
    for item in items:
        if chunk and size + item[0].numel() > CHUNK_NUMEL:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += item[0].numel()
    if chunk:
        yield chunk


def _adamw_chunk(chunk: list[tuple[Any, ...]], beta1: float, beta2: float, eps: float, decay: float) -> None:
    """torch.optim.AdamW's foreach update over one chunk, in fp32 (`.float()` of an fp32 tensor is the tensor)."""
    params, grads, avgs, sqs, step_sizes, bc2_sqrt = (list(x) for x in zip(*chunk))
    g = [t.float() for t in grads]
    m = [t.float() for t in avgs]
    v = [t.float() for t in sqs]
    torch._foreach_lerp_(m, g, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, 1 - beta2)
    if m[0] is not avgs[0]:  # stored rounded to nearest; the update below uses the fp32 values (as torchao does)
        torch._foreach_copy_(avgs, m)
        torch._foreach_copy_(sqs, v)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    w = [t.float() for t in params]
    torch._foreach_mul_(w, decay)
    torch._foreach_addcdiv_(w, m, denom, step_sizes)
    if w[0] is not params[0]:
        torch._foreach_copy_(params, w)


def planned_state_bytes(optimizer: torch.optim.Optimizer) -> int | None:
    """The bytes MomentsAdamW or AdamW8bit will allocate for their states over these (local) parameters, without
    allocating them (launch --dry-start): the two moments (8-bit: codes, scales and code books where torchao quantizes
    the shard, else the parameter's dtype: llmctl.spec.optimizer_states) and a 4-byte step each. None for another
    optimizer."""
    from llmctl.spec.optimizer_states import adam_8bit_bytes

    is_8bit = type(optimizer).__name__ == "AdamW8bit"  # adamw_8bit's class
    if not is_8bit and not isinstance(optimizer, MomentsAdamW):
        return None
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = _local(p)
            if is_8bit:
                total += adam_8bit_bytes(local.numel(), local.element_size()) + 4
            else:
                total += 2 * local.numel() * torch.empty((), dtype=optimizer.moments_dtype).element_size() + 4
    return total


# --- torchao's AdamW8bit --------------------------------------------------------------------------------------------
def torchao_optim() -> Any:
    """torchao.optim (llmctl.engine.ao: quietly, or one line naming the extra)."""
    from llmctl.engine import ao

    return ao.import_torchao("torchao.optim", "optimizer.states 8bit")


def adamw_8bit(groups: list[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
    """torchao's AdamW8bit (block size 256; tensors under 4,096 values keep plain moments), with two changes:

    - the learning rate stays a float in `param_groups`, as in torch's optimizers (the LR scheduler, the metrics and
      the checkpoints read it); torchao's step, which needs a tensor (a float would be a compile-time constant, one
      recompile per new LR), gets one for the step's duration;
    - torchao compiles its per-parameter step with torch.compile (fullgraph): on a CPU that is a C++ build per
      parameter shape (measured 70 s for a 3-tensor toy model), so there, and on the meta device, the step runs
      eagerly (`torch.compiler.set_stance("force_eager")`)."""
    base = torchao_optim().AdamW8bit

    class AdamW8bit(base):  # type: ignore[misc, valid-type]
        def add_param_group(self, param_group: dict[str, Any]) -> None:
            lr = param_group.get("lr", self.defaults["lr"])
            super().add_param_group(param_group)
            self.param_groups[-1]["lr"] = lr

        def step(self, closure: Any = None) -> Any:
            lrs = [g["lr"] for g in self.param_groups]
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = torch.tensor(float(lr), dtype=torch.float32)
            try:
                if not any(p.device.type in ("cpu", "meta") for g in self.param_groups for p in g["params"]):
                    return super().step(closure)
                with torch.compiler.set_stance("force_eager"):
                    return super().step(closure)
            finally:
                for g, lr in zip(self.param_groups, lrs):
                    g["lr"] = lr

    return AdamW8bit(groups, **kwargs)
