"""Precision policies: what each training precision keeps in which dtype, in one registry (torch-free).

A policy is the one place a precision's name is interpreted: the memory ledger reads its parameter, gradient and
optimizer-state dtypes, the cost model its compute dtype (the GPU peak) and reduce dtype (the bytes a gradient
collective moves), the engine its FSDP2 MixedPrecisionPolicy and the dtype the model is built in, the planner
whether the engine runs it and whether a GPU can. A new precision (fp8) is one entry in `POLICIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmctl.errors import InputError, UnknownNameError

if TYPE_CHECKING:
    from llmctl.spec.hardware import GPUSpec

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class PrecisionPolicy:
    """One training precision. Dtypes are the catalog's names (fp32, bf16, fp16)."""

    name: str
    param_dtype: str
    """What the parameters are stored in: the master weights the optimizer updates (FSDP2's sharded parameters)."""
    compute_dtype: str
    """What matmuls run in and activations are stored in (FSDP2's param_dtype for the unsharded copies); the GPU
    peak is read for it (fp32 reads the TF32 peak where a GPU has one)."""
    reduce_dtype: str
    """What gradients are reduced and kept in."""
    optimizer_state_dtype: str
    """What the optimizer's states (Adam's moments) are kept in."""
    loss_scaling: bool = False
    """fp16's narrow exponent needs the loss scaled to keep small gradients (a GradScaler)."""
    engine_runs: bool = True
    """Whether llmctl's engine trains with it (fp16-mixed needs loss scaling, which it does not do yet)."""
    description: str = ""

    @property
    def mixed(self) -> bool:
        """Compute in a half dtype over full-precision masters (a persistent or transient half copy of weights)."""
        return self.compute_dtype != self.param_dtype

    @property
    def flash_attention(self) -> bool:
        """flash-attention has kernels for half dtypes only (no fp32 kernel)."""
        return self.compute_dtype in ("bf16", "fp16")

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]

    @property
    def optimizer_state_bytes(self) -> int:
        return DTYPE_BYTES[self.optimizer_state_dtype]

    def check_engine(self) -> None:
        if not self.engine_runs:
            raise InputError(
                f"precision {self.name} is not run by llmctl's engine (it needs loss scaling)",
                hint="one of: " + ", ".join(ENGINE_PRECISIONS),
            )

    def check_gpu(self, gpu: GPUSpec) -> None:
        """One clear line when the GPU has no native kernels for this precision's compute dtype (bf16 on a V100)."""
        gpu.peak_tflops(self.compute_dtype)

    def __str__(self) -> str:
        return self.name


POLICIES: dict[str, PrecisionPolicy] = {
    p.name: p
    for p in (
        PrecisionPolicy("fp32", "fp32", "fp32", "fp32", "fp32", description="fp32 everywhere (TF32 matmuls on GPUs)"),
        PrecisionPolicy(
            "bf16-mixed",
            "fp32",
            "bf16",
            "fp32",
            "fp32",
            description="bf16 compute over fp32 master weights, fp32 gradient reduction (docs/sources.md#fsdp-seed)",
        ),
        PrecisionPolicy(
            "fp16-mixed",
            "fp32",
            "fp16",
            "fp32",
            "fp32",
            loss_scaling=True,
            engine_runs=False,
            description="fp16 compute",
        ),
        PrecisionPolicy("bf16", "bf16", "bf16", "bf16", "bf16", description="pure bf16: weights and states too"),
    )
}
PRECISIONS: tuple[str, ...] = tuple(POLICIES)
ENGINE_PRECISIONS: tuple[str, ...] = tuple(n for n in ("bf16-mixed", "bf16", "fp32") if POLICIES[n].engine_runs)
"""What llmctl's engine runs, in the order the help lists them."""


def policy(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The policy of a precision's name (any case, `_` for `-`); one line naming the choices when unknown."""
    if isinstance(name, PrecisionPolicy):
        return name
    v = str(name).strip().lower().replace("_", "-")
    if v not in POLICIES:
        raise UnknownNameError(f"unknown precision {name!r}", hint="choose one of: " + ", ".join(PRECISIONS))
    return POLICIES[v]
