"""Training precisions and the one map from a precision to its compute dtype (torch-free)."""

from __future__ import annotations

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
"""fp32; bf16/fp16 compute with fp32 master weights and reductions (mixed); pure bf16 (weights and states too)."""
ENGINE_PRECISIONS: tuple[str, ...] = ("bf16-mixed", "bf16", "fp32")
"""What llmctl's engine runs (fp16-mixed needs loss scaling, which it does not do)."""
COMPUTE_DTYPE: dict[str, str] = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}
"""The dtype matmuls run in: what a GPU's peak TFLOP/s is read for, and what activations are stored in."""
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def compute_dtype(precision: str) -> str:
    return COMPUTE_DTYPE[precision]


def compute_bytes(precision: str) -> int:
    return DTYPE_BYTES[COMPUTE_DTYPE[precision]]
