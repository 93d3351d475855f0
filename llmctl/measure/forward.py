"""A causal LM's training forward, layer by layer: the bytes each decoder layer and the head save for backward.

Run on fake tensors by llmctl.measure.fake (the model's meta tensors replaced by fake CPU ones: `to_fake`), or on a
real model (tests/measure/test_fake.py checks that both save the same bytes). The counting is the saved-bytes harness
(llmctl.measure.saved), by creator: a saved storage is charged to the region that *created* it, the decoder layer
running at the time, or the head (everything outside the layers: embeddings, rotary tables, masks, final norm, lm
head, loss). Charging by creation rather than by saver gives every layer the same bytes (each layer owns its output,
whoever saves it) and leaves tensors shared by all layers (RoPE cos/sin, masks) to the head once. Full activation
checkpointing wraps each layer in non-reentrant `torch.utils.checkpoint`; a checkpointed layer keeps alive every
tensor it was called with, which is counted too.

Fake tensors run the CPU kernels, which differ from the GPU ones in two places that change memory; both are patched
to what a GPU does while measuring: dropout keeps a 1-byte mask (`native_dropout`, as CUDA does) instead of a mask
in the activation dtype, and sdpa with dropout, or with a value head size unlike the query's (MLA), uses a fused
kernel (CUDA's flash/memory-efficient kernels drop out inside the kernel and take any value head size) instead of
the CPU's math fallback that saves the s*s probabilities. transformers also treats a fake tensor as "tracing" and
then assumes packed sequences (a mask, no GQA in sdpa); the batch here is one unpadded sequence per row, so
packed-sequence detection is switched off. MoE layers run transformers' grouped-mm experts: every token's top-k rows,
whatever the routing (fake tensors have no values to route by), as the grouped GEMM kernels of GPU training do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.checkpoint import checkpoint

from llmctl.measure.saved import OUTSIDE, SavedBytes, storage_key


def to_fake(model: Any, mode: Any) -> Any:
    """Replace the meta model's parameters, buffers and tensor attributes by fake CPU tensors of the same shape and
    dtype (tied parameters stay tied)."""
    memo: dict[int, Any] = {}

    def fake(t: Any) -> Any:
        if id(t) not in memo:
            with mode:
                new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
        return memo[id(t)]

    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake(t)
        for name, t in list(vars(m).items()):
            if isinstance(t, torch.Tensor):  # e.g. rotary embeddings' original_inv_freq, a plain attribute
                setattr(m, name, fake(t))
    return model


@contextlib.contextmanager
def _as_on_gpu() -> Iterator[None]:
    """Patch the CPU/GPU differences that change saved memory (module docstring) for the duration."""
    import importlib
    from unittest import mock

    import torch.nn.functional as F

    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def gpu_dropout(input, p=0.5, training=True, inplace=False):  # noqa: ANN001, A002 - F.dropout's signature
        if training and 0.0 < p < 1.0:
            return torch.native_dropout(input, p, True)[0]  # saves a bool mask, as CUDA's dropout does
        return dropout(input, p, training, inplace)

    def gpu_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001
        if query.shape[-1] != value.shape[-1] and key.shape[-3] == query.shape[-3] and _is_fake(query):
            # MLA (v_head_dim != qk head dim): CUDA runs the memory-efficient kernel (flash needs equal head dims),
            # which keeps q, k, v, the output and a logsumexp; the CPU would fall back to the math path and keep the
            # s*s probabilities. The efficient kernel has a fake (meta) implementation and a derivative.
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch converts it for that kernel
                attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
            efficient = torch.ops.aten._scaled_dot_product_efficient_attention
            return efficient(query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]
        if dropout_p > 0.0 and not enable_gqa:  # the fused kernel drops out inside: no s*s tensor is saved
            cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return cpu_flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    transformers_patches = [
        ("transformers.masking_utils", "find_packed_sequence_indices", lambda position_ids: None),
        # torch's grouped_mm has fake kernels for bf16 only; transformers' own grouped-mm op saves the same tensors
        # (the sorted token rows; the weights are parameters) and has a fake kernel for every dtype
        ("transformers.integrations.moe", "_can_use_grouped_mm", lambda *args, **kwargs: False),
    ]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(F, "dropout", gpu_dropout))
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", gpu_sdpa))
        for module_name, name, replacement in transformers_patches:
            try:
                module = importlib.import_module(module_name)
            except ImportError:  # an older transformers without it: nothing to patch
                continue
            if hasattr(module, name):
                stack.enter_context(mock.patch.object(module, name, replacement))
        yield


def _is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


class _CheckpointedForward:
    """A layer's forward run under non-reentrant checkpointing (set as the instance's `forward`, so hooks on the
    layer run outside the checkpoint)."""

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


def saved_bytes(
    model: Any,
    layers: Any,
    batch: int,
    seq: int,
    checkpointing: str = "none",
    mode: Any = None,
    key: Callable[[Any], int] = storage_key,
) -> tuple[list[int], int]:
    """(bytes each decoder layer saves for backward, bytes the head saves) in one training forward of a `batch` x
    `seq` batch. `mode` is the FakeTensorMode the model's tensors belong to (None: a real model); `key` identifies
    storages (storage_key for fake tensors; a real run may use data_ptr)."""
    # Parameters, buffers and the batch are not activations.
    saved = SavedBytes((*model.parameters(), *model.buffers()), key=key, by_creator=True)
    handles = saved.track(layers, keep_inputs=checkpointing == "full")
    if checkpointing == "full":
        for layer in layers:
            layer.forward = _CheckpointedForward(layer.forward)
    try:
        model.train()
        with contextlib.ExitStack() as stack:
            if mode is not None:
                stack.enter_context(mode)
            stack.enter_context(_as_on_gpu())
            ids = torch.zeros(batch, seq, dtype=torch.long)
            saved.exclude(ids)
            stack.enter_context(saved)
            output = model(input_ids=ids, labels=ids)
        # Counted while `output` keeps the autograd graph alive: what is still there is what backward will use.
        regions = saved.by_region()
        del output
    finally:
        for h in handles:
            h.remove()
        for layer in layers:
            if isinstance(vars(layer).get("forward"), _CheckpointedForward):
                del layer.forward
    return [regions.get(i, 0) for i in range(len(layers))], regions.get(OUTSIDE, 0)
