"""Context parallelism: each sequence split over the cp ranks of the mesh, attention run as torch's ring attention.

torch's `context_parallel` (torch.distributed.tensor.experimental, torchtitan's long-context recipe) does the work:
inside it, `F.scaled_dot_product_attention` takes the rank's queries, keys and values as DTensors sharded on the
sequence, and DTensor dispatches SDPA's kernel to `_templated_ring_attention`, which rotates the keys/values round
the cp group (one all-gather, or cp-1 neighbour exchanges: `set_rotate_method`) and merges each step's partial
output through its log-sum-exp; backward rotates them again with the dK/dV accumulators. With the head-tail load
balance (`_HeadTailLoadBalancer`) the sequence is cut in 2cp chunks and rank i holds chunks i and 2cp-1-i, so every
rank does the same causal work.

What this module adds around it:
- **The CPU kernel in the ring.** torch 2.13 registers ring handlers for the CUDA SDPA kernels only (flash,
  memory-efficient, cuDNN and their backwards). On a CPU, SDPA runs `aten._scaled_dot_product_flash_attention_for_cpu`,
  which returns the output and the log-sum-exp a ring merge needs, as the CUDA flash kernel does. `install_cpu_ring`
  registers that op and its backward with the same `_templated_ring_attention(_backward)` (a sharding rule that
  keeps q, k, v, out and lse sharded on the sequence, and a DTensor handler in torch's CP table): the gloo tests run
  torch's own ring, rotation and load balance, and only the per-block kernel differs from a GPU run.
- **The model's attention.** Hugging Face builds a causal mask from the positions it sees; the rank's positions are
  two chunks of the sequence, which it would read as packed documents. `use_ring_attention` registers an attention
  function (`llmctl_ring`: transformers' own SDPA call, keys/values not repeated, GQA in the kernel) and a mask
  function that builds no mask, so every layer calls SDPA with is_causal=True and no mask, the only form the ring
  runs (families whose attention is anything else are refused: llmctl.families.context_parallel).
- **The batch.** `SequenceSplit` cuts a micro-batch's input ids, targets (already shifted) and positions (0..s-1)
  the same way, the positions feeding the rotary tables, and keeps the dispatcher on for forward and backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmctl.engine.data import Batch
from llmctl.spec.attention import Attention

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

RING = "llmctl_ring"
"""The attention implementation name (transformers' AttentionInterface) of ring attention."""
SEQ_DIM = 2
"""SDPA's (batch, heads, sequence, head_dim): the dimension the ring shards."""


def _cpu_ops() -> tuple[Any, Any]:
    import torch

    aten = torch.ops.aten
    return (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )


def _forward_rule(op_schema: Any) -> Any:
    """Sharding rule: out, lse, q, k, v all sharded on the sequence (the only layout ring attention runs)."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    mesh = op_schema.get_mesh_from_args()
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 5], input_index=2)


def _backward_rule(op_schema: Any) -> Any:
    """grad_q, grad_k, grad_v, grad_out, q, k, v, out, lse: all sharded on the sequence."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    mesh = op_schema.get_mesh_from_args(validate=False)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(SEQ_DIM)] * 9], input_index=3)


def _ring_forward(mesh: DeviceMesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):  # noqa: ANN001, ANN202
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    if attn_mask is not None:
        raise NotImplementedError("ring attention runs without a mask (is_causal only)")
    fwd, _ = _cpu_ops()
    return _templated_ring_attention(
        mesh.get_group(), SEQ_DIM, fwd, query=query, key=key, value=value, is_causal=is_causal,
        dropout_p=dropout_p, scale=scale,
    )  # fmt: skip


def _ring_backward(
    mesh: DeviceMesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):  # noqa: ANN001, ANN202, E501
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward

    _, bwd = _cpu_ops()
    return _templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, bwd, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key,
        value=value, out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
    )  # fmt: skip


def _cpu_ring_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch's `_sdpa_handler` for the CPU kernel: propagate the sharding, run the ring on local tensors, wrap."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    sharding = info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError("ring attention's inputs must all be sharded on the sequence")
    fwd, _ = _cpu_ops()
    local = _ring_forward if op_call is fwd else _ring_backward
    return dispatcher.wrap(local(info.compute_mesh, *info.local_args, **info.local_kwargs), sharding.output_spec)


_installed = False


def install_cpu_ring() -> None:
    """Register the CPU SDPA kernel and its backward with torch's ring attention (idempotent). The handlers are
    consulted only while a `context_parallel` context is on (torch merges its CP table into DTensor's handlers on
    entry and takes it out on exit)."""
    global _installed
    if _installed:
        return
    from torch.distributed.tensor._ops.utils import register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention

    fwd, bwd = _cpu_ops()
    register_op_strategy(fwd)(_forward_rule)
    register_op_strategy(bwd)(_backward_rule)
    _attention.custom_ops[fwd] = _cpu_ring_handler
    _attention.custom_ops[bwd] = _cpu_ring_handler
    _installed = True


def _ring_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' SDPA attention with no mask: is_causal=True (its rule: no mask, more than one query), keys and
    values not repeated (enable_gqa), the form torch's ring handlers run."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def use_ring_attention(model: torch.nn.Module) -> None:
    """Make every attention layer of `model` (built with SDPA) call ring-ready SDPA: causal, no mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(RING, _ring_attention)
    AttentionMaskInterface.register(RING, _no_mask)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == Attention.SDPA.hf_name:
            config._attn_implementation = RING


def cp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The cp dimension of the engine's mesh (None without context parallelism)."""
    return mesh["cp"] if "cp" in (mesh.mesh_dim_names or ()) else None


@dataclass(frozen=True)
class SequenceSplit:
    """Cuts micro-batches over a cp mesh, with the run's load balance and rotation."""

    mesh: DeviceMesh
    load_balance: bool = True
    rotate: str = "allgather"

    @contextlib.contextmanager
    def __call__(self, batch: Batch) -> Iterator[Batch]:
        """This rank's part of `batch` (input ids, targets, positions), with ring attention on until the block ends
        (forward and backward must both run inside it)."""
        import torch
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

        b, s = batch.inputs.shape
        positions = torch.arange(s, device=batch.inputs.device).expand(b, s).contiguous()
        # context_parallel resizes its buffers in place: give it copies it owns (the batch rows are views).
        bufs = [batch.inputs.clone(), batch.targets.clone(), positions]
        set_rotate_method(self.rotate)
        _cp_options.enable_load_balance = self.load_balance
        with context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(bufs)):
            yield Batch(inputs=bufs[0], targets=bufs[1], positions=bufs[2])


@contextlib.contextmanager
def whole(batch: Batch) -> Iterator[Batch]:
    """No context parallelism: the micro-batch as it is."""
    yield batch
