"""The language-model loss: the LM head and cross-entropy, whole or over chunks of tokens.

Whole (`training.loss_chunk_tokens: 0`): Hugging Face's forward returns the b*s*V logits (compute dtype), the loss
upcasts them to fp32 and its log-softmax keeps an fp32 b*s*V copy for backward. With Llama 3's 128k vocabulary at
b*s = 16k tokens that is 12 GiB before backward adds two more fp32 copies.

Chunked (N > 0): the model's forward is replaced, on this instance only, by one that runs the base model, then the
LM head and cross-entropy chunk by chunk of N tokens, each chunk under non-reentrant checkpointing: forward keeps
only the final hidden states (already kept for the head's backward), backward recomputes one chunk's logits at a time.
The replacement runs inside the model's forward, so FSDP2's root hooks still gather the LM head before it and
reduce-scatter its gradient after backward. Cost: the LM head's forward matmul runs twice (2*N*h*V FLOPs per chunk);
the memory model (llmctl.plan.memory) and the planner count both.

Liger (CUDA, `liger-kernel` installed, optional extra [liger]): its fused linear cross-entropy (triton kernels that
compute the gradient during forward, chunked) is used instead of the checkpointed chunks; selected like
flash-attn, by what the machine has, and stated in the start event.
"""

from __future__ import annotations

import importlib.util
import types
from typing import TYPE_CHECKING

from llmctl.errors import SpecError

if TYPE_CHECKING:
    import torch

IMPLS = ("whole", "chunked", "liger", "parallel")


def liger_importable() -> bool:
    """liger-kernel is installed (without importing it: its import loads triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def select_loss(
    chunk_tokens: int, cuda_available: bool, liger_available: bool, tp: int = 1, pp: int = 1
) -> tuple[str, str]:
    """(implementation, why): loss parallel under tensor parallelism, whole under pipeline parallelism (the last
    stage returns the logits and the schedule's loss function takes them), whole when chunking is off, liger on CUDA
    where installed, else checkpointed chunks."""
    if tp > 1:
        return "parallel", f"tp {tp}: cross-entropy on the LM head's vocabulary shards (loss_parallel)"
    if pp > 1:
        return "whole", f"pp {pp}: the last stage's whole logits"
    if chunk_tokens <= 0:
        return "whole", "loss_chunk_tokens 0: whole logits"
    if cuda_available and liger_available:
        return "liger", "liger-kernel installed and CUDA present: fused linear cross-entropy"
    missing = "no CUDA" if not cuda_available else "liger-kernel not installed"
    return "chunked", f"{missing}: checkpointed chunks of {chunk_tokens} tokens"


def _head_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, float | None]:
    """(base model, LM head, final logit soft-cap or None) of a Hugging Face causal LM."""
    base = getattr(model, "base_model", None)
    if base is model:  # Llama 4's text LM keeps the multimodal prefix ("language_model") but its body in `model`
        base = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or head is None or not hasattr(head, "weight"):
        raise SpecError(
            f"chunked loss: cannot find the base model and LM head of {type(model).__name__}",
            hint="set training.loss_chunk_tokens: 0",
        )
    for attr in ("logit_scale", "logits_scaling"):  # Cohere multiplies its logits by one, Granite divides by the other
        v = getattr(model.config, attr, None)
        if v is not None and v != 1:
            raise SpecError(
                f"chunked loss: {type(model).__name__} scales its logits ({attr} {v}), which the chunked loss does not do",
                hint="set training.loss_chunk_tokens: 0",
            )
    # Gemma 2's cap (tanh(x / c) * c, after the LM head): transformers applies it in the compute dtype and then
    # upcasts; chunk_loss_sum upcasts first (the same numbers in fp32, a rounding step fewer in bf16).
    cap = getattr(model.config, "final_logit_softcapping", None)
    return base, head, cap


def chunk_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab: int,
    softcap: float | None,
) -> torch.Tensor:
    """Summed cross-entropy of one chunk: hidden (n, h), targets (n,), over the real vocabulary (the padded rows of
    the LM head are never a target and take no probability mass)."""
    import torch
    import torch.nn.functional as F

    logits = F.linear(hidden, weight, bias)[:, :vocab].float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, reduction="sum")


def chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab: int,
    chunk_tokens: int,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over the targets other than -100 (their mean, as F.cross_entropy's, or their sum), computed chunk
    by chunk (each chunk recomputed in backward)."""
    from torch.utils.checkpoint import checkpoint

    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    n = t.numel()
    total = None
    for start in range(0, n, chunk_tokens):
        part = checkpoint(
            chunk_loss_sum,
            h[start : start + chunk_tokens],
            weight,
            bias,
            t[start : start + chunk_tokens],
            vocab,
            softcap,
            use_reentrant=False,
            preserve_rng_state=False,  # the head and loss draw no random numbers
        )
        total = part if total is None else total + part
    assert total is not None
    # The mean over the real targets, not over all n positions: masked (-100) targets count for nothing.
    return total if reduction == "sum" else total / (t != -100).sum()


def liger_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    vocab: int,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Liger's fused linear cross-entropy over the real vocabulary rows of the head (mean over tokens, or sum)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    h = hidden.reshape(-1, hidden.shape[-1])
    kw: dict[str, object] = {"reduction": reduction}
    if softcap:
        kw["softcap"] = softcap
    fused = LigerFusedLinearCrossEntropyLoss(**kw)
    return fused(weight[:vocab], h, targets.reshape(-1), None if bias is None else bias[:vocab])


def install_loss_forward(model: torch.nn.Module, impl: str, vocab: int, chunk_tokens: int) -> None:
    """Replace this model's forward by `forward(input_ids, labels, reduction="mean") -> loss` computed with `impl`
    (chunked or liger; reduction "sum" skips targets of -100, for evaluation). Module hooks (FSDP2's) still run around
    it: nn.Module.__call__ reads self.forward."""
    base, head, cap = _head_parts(model)

    def forward(
        self: torch.nn.Module,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        reduction: str = "mean",
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        if impl == "liger":
            return liger_loss(hidden, head.weight, head.bias, labels, vocab, cap, reduction)
        return chunked_loss(hidden, head.weight, head.bias, labels, vocab, chunk_tokens, cap, reduction)

    model.forward = types.MethodType(forward, model)


def whole_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    reduction: str = "mean",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hugging Face's forward (b*s*V logits) and cross-entropy in fp32 over the real vocabulary. `positions`: the
    tokens' positions when the rank holds part of each sequence (context parallelism), else None (0..s-1)."""
    import torch.nn.functional as F

    logits = model(input_ids=inputs, position_ids=positions).logits
    return F.cross_entropy(logits[..., :vocab].float().reshape(-1, vocab), targets.reshape(-1), reduction=reduction)


def parallel_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    reduction: str = "mean",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy on the vocabulary shards of a tensor-parallel LM head (logits a DTensor sharded on their last
    dimension); call it, and the loss's backward, inside `torch.distributed.tensor.parallel.loss_parallel()`. The
    padded vocabulary columns (model.pad_vocab_multiple) are set to -inf on the rank that holds them: they take no
    probability mass and get no gradient, as the whole loss's slice to the real vocabulary does."""
    logits = model(input_ids=inputs, position_ids=positions).logits.float()
    return vocab_shards_loss(logits, targets, vocab, reduction)


def vocab_shards_loss(logits: torch.Tensor, targets: torch.Tensor, vocab: int, reduction: str = "mean") -> torch.Tensor:
    """`parallel_loss`'s cross-entropy of fp32 logits that are a DTensor sharded on their last dimension (the
    vocabulary), the padded columns at -inf; inside `loss_parallel()` (a pipeline's last stage calls it too)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    padded = logits.shape[-1]
    if padded > vocab:
        local = logits.to_local()
        n = local.shape[-1]
        start = logits.device_mesh.get_local_rank() * n  # Shard(-1): rank r holds columns [r*n, (r+1)*n)
        if start + n > vocab:
            keep = max(0, vocab - start)
            local = local.clone()
            local[..., keep:] = float("-inf")
        logits = DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False)
    return F.cross_entropy(logits.reshape(-1, padded), targets.reshape(-1), reduction=reduction)


def model_loss(
    model: torch.nn.Module,
    impl: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    reduction: str = "mean",
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cross-entropy (mean over the targets, or their sum skipping -100) with the run's loss implementation;
    "parallel" must run, with its backward, inside `loss_parallel()` (it returns a replicated DTensor)."""
    if impl == "whole":
        return whole_loss(model, inputs, targets, vocab, reduction, positions)
    if impl == "parallel":
        return parallel_loss(model, inputs, targets, vocab, reduction, positions)
    return model(input_ids=inputs, labels=targets, reduction=reduction, position_ids=positions)


def loss_sum(
    model: torch.nn.Module,
    impl: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed cross-entropy over the targets that are not -100, with the run's loss implementation."""
    if impl == "parallel":
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return local_value(model_loss(model, impl, inputs, targets, vocab, "sum", positions))
    return model_loss(model, impl, inputs, targets, vocab, "sum", positions)


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (loss parallel returns a replicated DTensor: every rank holds the value)."""
    return loss.to_local() if hasattr(loss, "to_local") else loss
