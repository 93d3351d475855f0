"""Precision policies: what each training precision keeps in which dtype, in one registry (torch-free).

A policy is the one place a precision's name is interpreted: the memory ledger reads its parameter, gradient and
optimizer-state dtypes, the cost model its compute dtype (the GPU peak) and reduce dtype (the bytes a gradient
collective moves), the engine its FSDP2 MixedPrecisionPolicy, the dtype the model is built in, whether a loss scaler
runs and which float8 recipe converts the linear layers, the planner whether a GPU can run it. No other module
compares precision names: they ask a policy. A new precision is one entry in `POLICIES` (and its aliases in
`ALIASES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmctl.errors import InputError, UnknownNameError

if TYPE_CHECKING:
    from llmctl.spec.hardware import GPUSpec

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
"""torchao's float8 training recipes (torchao/float8/config.py Float8LinearRecipeName): one scale per tensor (the
fastest; its weights can be all-gathered in float8 by FSDP2), or one scale per row (more accurate, bf16 all-gather)."""


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
    """fp16's narrow exponent (max 65504, smallest normal 6e-5) needs the loss scaled so small gradients survive,
    and steps with overflowed gradients skipped (a dynamic loss scaler, llmctl.engine.scaler)."""
    float8_recipe: str | None = None
    """float8 training: the linear layers' matmuls run on float8 tensor cores with torchao's dynamic scaling recipe
    (one of FLOAT8_RECIPES); everything else (attention, norms, the LM head) computes in `compute_dtype`."""
    engine_runs: bool = True
    """Whether llmctl's engine trains with it."""
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
    def float8(self) -> bool:
        return self.float8_recipe is not None

    @property
    def float8_all_gather(self) -> bool:
        """FSDP2 all-gathers float8 weights (1 byte a parameter instead of 2) under the tensorwise recipe only
        (torchao's enable_fsdp_float8_all_gather; rowwise scales are per row of the transposed use too)."""
        return self.float8_recipe == "tensorwise"

    @property
    def float8_row_scales(self) -> bool:
        """One fp32 scale per row of each float8 operand (rowwise), not one per tensor (tensorwise)."""
        return self.float8_recipe == "rowwise"

    @property
    def linear_dtype(self) -> str:
        """The dtype the linear layers' matmuls run in: fp8 under a float8 recipe, else the compute dtype. The cost
        model reads the GPU's peak for it on the linear FLOPs, and the compute dtype's on the rest."""
        return "fp8" if self.float8 else self.compute_dtype

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
                f"precision {self.name} is not run by llmctl's engine", hint="one of: " + ", ".join(ENGINE_PRECISIONS)
            )

    def check_gpu(self, gpu: GPUSpec) -> None:
        """One clear line when the GPU has no native kernels for this precision's compute dtype (bf16 on a V100) or
        no float8 tensor cores (an A100 under fp8)."""
        if self.float8:  # first: on a V100 the missing float8 is the news, not the missing bf16
            gpu.peak_tflops(self.linear_dtype)
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
            description="fp16 compute over fp32 masters with dynamic loss scaling: GPUs without bf16 (V100, T4) "
            "(Micikevicius et al. 2018, https://arxiv.org/abs/1710.03740)",
        ),
        PrecisionPolicy("bf16", "bf16", "bf16", "bf16", "bf16", description="pure bf16: weights and states too"),
        PrecisionPolicy(
            "fp8-tensorwise",
            "fp32",
            "bf16",
            "fp32",
            "fp32",
            float8_recipe="tensorwise",
            description="bf16-mixed with the linear layers on float8 tensor cores, one scale per tensor, float8 "
            "weight all-gather (torchao; torchtitan docs/float8.md)",
        ),
        PrecisionPolicy(
            "fp8-rowwise",
            "fp32",
            "bf16",
            "fp32",
            "fp32",
            float8_recipe="rowwise",
            description="bf16-mixed with the linear layers on float8 tensor cores, one scale per row (torchao)",
        ),
    )
}
ALIASES: dict[str, str] = {
    "fp16": "fp16-mixed",
    "16-mixed": "fp16-mixed",
    "bf16-true": "bf16",
    "32": "fp32",
    "32-true": "fp32",
    "fp8": "fp8-tensorwise",
    "float8": "fp8-tensorwise",
    "float8-tensorwise": "fp8-tensorwise",
    "float8-rowwise": "fp8-rowwise",
}
"""Short names that mean one policy each (Lightning's `16-mixed` / `bf16-true` spellings too). `bf16` is not an
alias: it is pure bf16 (weights and optimizer states in bf16), as plan files have always said."""
PRECISIONS: tuple[str, ...] = tuple(POLICIES)
ENGINE_PRECISIONS: tuple[str, ...] = tuple(
    n for n in ("bf16-mixed", "bf16", "fp32", "fp16-mixed", "fp8-tensorwise", "fp8-rowwise") if POLICIES[n].engine_runs
)
"""What llmctl's engine runs, in the order the help lists them."""
PRECISION_HELP = "bf16-mixed | fp16 (fp16-mixed, loss-scaled) | fp8 (fp8-tensorwise) | fp8-rowwise | bf16 (pure) | fp32"
"""The one help text of `--precision` (estimate, plan, tune)."""


def policy(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The policy of a precision's name or alias (any case, `_` for `-`); one line naming the choices when
    unknown."""
    if isinstance(name, PrecisionPolicy):
        return name
    v = str(name).strip().lower().replace("_", "-")
    v = ALIASES.get(v, v)
    if v not in POLICIES:
        raise UnknownNameError(
            f"unknown precision {name!r}", hint="choose one of: " + ", ".join((*PRECISIONS, "fp16", "fp8"))
        )
    return POLICIES[v]


AUTO = "auto"
"""The precision the GPU trains best in without changing the recipe: `for_gpu`."""


def for_gpu(name: str | PrecisionPolicy | None, gpu: GPUSpec | None) -> tuple[PrecisionPolicy, str | None]:
    """The policy of a --precision, with `auto` (or None) resolved for the GPU: bf16-mixed where it has bf16 tensor
    cores, else fp16-mixed where it has fp16 ones (V100, T4: loss-scaled), else fp32. Returns (policy, why) where
    why says what auto chose on a GPU without bf16 (None otherwise); a named precision is checked against the GPU
    (one line when it cannot run there)."""
    if name is None or (isinstance(name, str) and name.strip().lower() == AUTO):
        if gpu is None or gpu.tflops.get("bf16") is not None:
            return POLICIES["bf16-mixed"], None
        if gpu.tflops.get("fp16") is not None:
            return POLICIES["fp16-mixed"], (
                f"fp16-mixed: {gpu.name} has no bf16 tensor cores; fp16 with dynamic loss scaling runs at "
                f"{gpu.tflops['fp16']:g} TFLOP/s peak vs {gpu.peak_tflops('fp32'):g} for fp32"
            )
        return POLICIES["fp32"], f"fp32: {gpu.name} has no bf16 or fp16 tensor cores"
    p = policy(name)
    if gpu is not None:
        p.check_gpu(gpu)
    return p, None


FLOAT8_DIM_MULTIPLE = 16
"""float8 matmuls (cuBLASLt's _scaled_mm) need both dimensions of a weight divisible by 16: torchao's
_auto_filter_for_recipe rule 1 (torchao/float8/float8_linear_utils.py). Linear layers of other shapes stay in the
compute dtype (a MoE router over 8 experts, GPT-2's vocabulary of 50257)."""


def float8_convertible(in_features: int, out_features: int, lm_head: bool = False) -> bool:
    """Whether torchao's float8 conversion takes a linear layer of this shape (the engine's filter and the cost
    model's count both ask this). The LM head is never converted: its logits feed the loss directly and lose too much
    in float8 (torchtitan's float8 converter skips `output`, docs/float8.md)."""
    return not lm_head and in_features % FLOAT8_DIM_MULTIPLE == 0 and out_features % FLOAT8_DIM_MULTIPLE == 0
