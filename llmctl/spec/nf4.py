"""QLoRA's 4-bit NormalFloat base as llmctl's engine stores it (torchao's NF4Tensor, llmctl/engine/qlora.py), sized
without torch: the memory model and the engine share these rules.

A weight of n values: n/2 bytes of 4-bit codes, one int8 absmax per block of 64 values, one scale in the compute
dtype per `s` absmaxes (double quantization), and per shard a mean of the absmaxes and the 16-value NF4 table in the
compute dtype (QLoRA, Dettmers et al. 2023, arXiv:2305.14314 section 2; torchao's `NF4Tensor.from_tensor`, the
tensors `__tensor_flatten__` lists). FSDP2 splits each of those tensors evenly, so a weight is stored in NF4 only
where every piece holds whole blocks (`scaler_block`); the others stay in the compute dtype.
"""

from __future__ import annotations

import math

BLOCK = 64
"""Values per absmax block (torchao's and bitsandbytes' default, the paper's)."""
SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)
"""Absmaxes per scale, the paper's 256 first."""
TABLE_VALUES = 17
"""Per shard, in the compute dtype: the absmaxes' mean and the 16 NF4 levels."""


def scaler_block(shape: tuple[int, ...], shard: int) -> int | None:
    """The double-quantization block (absmaxes per scale) for a weight cut into `shard` row pieces, or None when NF4
    cannot shard it: each piece must hold whole 64-value blocks and whole scale blocks, so the weight's blocks must be
    a multiple of s x shard and its rows of shard. 256 where that holds, else the largest power of two below it that
    does (more scales: 2 bytes per 64 s values in bf16; llama-tiny's 688 x 256 MLP on 2 ranks takes 32)."""
    if not shape:
        return None
    rows, numel = int(shape[0]), math.prod(shape)
    if numel % BLOCK or rows % shard:
        return None
    blocks = numel // BLOCK
    return next((s for s in SCALER_BLOCKS if blocks % (s * shard) == 0), None)


def nf4_bytes(shape: tuple[int, ...], shard: int, compute_bytes: int) -> float | None:
    """Bytes of one weight in NF4 over all its `shard` pieces (None: it stays in the compute dtype)."""
    s = scaler_block(shape, shard)
    if s is None:
        return None
    n = math.prod(shape)
    return n / 2 + n / BLOCK + compute_bytes * n / (BLOCK * s) + shard * compute_bytes * TABLE_VALUES


BYTES_PER_WEIGHT_BF16 = 0.5 + 1 / BLOCK + 2 / (BLOCK * 256)
"""A large bf16 weight's NF4 bytes per value (the scale blocks at 256): 4.125 bits."""
