"""Context parallelism's ring attention: the bytes one rank holds while one attention call runs (torch-free).

The engine runs torch's ring attention (torch.distributed.tensor.experimental, `_templated_ring_attention` and
`_templated_ring_attention_backward` in `_context_parallel/_attention.py`, torch 2.6-2.13) around transformers' SDPA
call. What autograd saves is what the same SDPA call saves without cp, on this rank's S/cp tokens (q, k and v on
kv heads, the output, the fp32 logsumexp: llmctl.plan.memory.activations at S/cp); this module sizes what exists
only while one layer's attention runs, read off that code. Per rank, with b sequences of s = S/cp tokens, a and kv
this rank's query and key/value heads (divided by tp), head size d, the compute dtype's ab bytes:

    Q  = b a s d      elements of q (and of the output: cp needs value heads as wide as the query heads)
    K  = b kv s d     elements of k (and of v)
    KV = 2 K ab       bytes of one rank's keys and values (`torch.cat([key.flatten(), value.flatten()])`)

Forward, at a ring step i >= 1 (the merge; step 0 is counted too and the larger taken):
- K/V in flight: with the all-gather rotation the gathered buffer of all cp ranks' K/V (cp KV) lives for the whole
  call (step 0 also holds the contiguous copies of k and v, `key.contiguous()` of transformers' transposed views,
  and the concatenated send copy: cp + 2); with the all-to-all rotation the block being used, its concatenated send
  copy and the block being received (3 KV; 1 at the last step, so 1 at cp = 2 after step 0).
- the fp32 merge (`_SDPAMerger` with `convert_to_f32`): the running output (4Q), the step's output in the compute
  dtype (ab Q) and upcast (4Q; the same tensor in fp32), and two fp32 temporaries of
  `out - sigmoid(lse_i - lse) * (out - out_i)` alive at once (8Q): (16 + ab) Q bytes, or 16 Q in fp32; the
  logsumexps (b a s fp32, four at once) on top.
Backward, at a step i >= 1:
- K/V in flight as in the forward (the same rotation: `_create_rotater(group, 2)`).
- fp32 gradients: grad_query's accumulator (4Q); dK/dV always go round by all-to-all in fp32
  (`_create_rotater(..., method=ALL_TO_ALL)`): the accumulator received and added to, its concatenated send copy and
  the next one being received (3 x 8K); the step's own gradients from the SDPA backward in the compute dtype
  (ab (Q + 2K)); with the head-tail split `_partial_update` rebuilds a half-updated accumulator with `torch.cat`:
  one more copy of the larger of grad_query and the dK/dV pair (max(4Q, 8K)).
With whole-block checkpointing (full, partial) the recompute runs the forward ring again inside the backward phase: that
phase holds the larger of the two (selective keeps the attention kernel's output and does not). Kernel workspaces (flash-attention's fp32 dq accumulator, as without cp) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import TrainSetup


@dataclass(frozen=True)
class RingBuffers:
    """Bytes one rank holds during one attention call of ring attention (module docstring), at the peak step."""

    forward_kv: int
    """K/V blocks in flight in the forward (gathered or passed on)."""
    forward_merge: int
    """The fp32 merge of the steps' partial outputs and logsumexps."""
    backward_kv: int
    """K/V blocks in flight in the backward (or the recompute's forward, when that is larger)."""
    backward_grads: int
    """fp32 gradient accumulators, the dK/dV rotation and the step's gradients (or the recompute's merge)."""
    backward_is_recompute: bool = False
    """The backward phase's peak is the recompute's forward ring (checkpointing), not the backward's."""

    @property
    def forward(self) -> int:
        return self.forward_kv + self.forward_merge

    @property
    def backward(self) -> int:
        return self.backward_kv + self.backward_grads


def _shape(spec: ModelSpec, setup: TrainSetup) -> tuple[int, int, int]:
    """(Q, K, logsumexp elements) of the largest attention on this rank (module docstring)."""
    shard = setup.dims.rank_shard(setup.seq_len)
    b, s = setup.micro_batch_size, shard.tokens
    best = (0, 0, 0)
    for layer, _ in spec.layer_groups:
        at = layer.attention
        a, kv = shard.columns(at.num_heads), shard.columns(at.num_kv_heads)
        shape = (b * a * s * at.head_dim, b * kv * s * at.head_dim, b * a * s)
        best = max(best, shape)
    return best


def kv_blocks(cp: int, rotate: str, step: int) -> int:
    """K/V blocks (of one rank's keys and values) alive at a ring step beyond the saved k and v (module docstring):
    step 0 or a later step (1), all-gather or all-to-all rotation."""
    if rotate == "allgather":
        return cp + 2 if step == 0 else cp
    return 3 if step == 0 or cp >= 3 else 1


def ring_buffers(spec: ModelSpec, setup: TrainSetup) -> RingBuffers:
    """The ring's transient bytes per rank (zeros at cp = 1). Module docstring for each term."""
    if setup.cp <= 1:
        return RingBuffers(0, 0, 0, 0)
    q, k, lse = _shape(spec, setup)
    ab, cp, rotate = setup.compute_bytes, setup.cp, setup.cp_rotate
    kv = 2 * k * ab
    upcast = 4 if ab != 4 else 0  # out.to(float32) is a copy unless the output already is fp32
    step0 = (kv_blocks(cp, rotate, 0) * kv, (ab + upcast) * q + 4 * lse)
    later = (kv_blocks(cp, rotate, 1) * kv, (12 + ab + upcast) * q + 16 * lse)
    fwd = max(step0, later, key=sum)
    partial = max(4 * q, 8 * k) if setup.cp_load_balance else 0
    bwd = (kv_blocks(cp, rotate, 1) * kv, 4 * q + 3 * 8 * k + ab * (q + 2 * k) + partial)
    # Whole-block recompute re-runs the attention; selective keeps the fused kernel's output (no ring again).
    recompute = setup.checkpointing not in ("none", "selective") and sum(fwd) > sum(bwd)
    if recompute:
        bwd = fwd
    return RingBuffers(fwd[0], fwd[1], bwd[0], bwd[1], recompute)
