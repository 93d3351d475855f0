"""The attention kernels a plan may ask for, as one type (torch-free).

`Attention` is a `str` enum: a plan file, a flag and JSON keep the plain names (`sdpa`), and code asks the kernel what
it is (`keeps_scores`, `runs_ring`, `needs_half`) instead of comparing names. Which kernel a model really runs
(Gemma 2 and gpt-oss have no SDPA path) is the model's answer (`ModelSpec.attention_kernel`); which one `auto` becomes on
a machine is the setup's (`TrainSetup.kernel`) and the engine's (`llmctl.engine.model.select_attention`).
"""

from __future__ import annotations

from enum import StrEnum

from llmctl.errors import UnknownNameError


class Attention(StrEnum):
    AUTO = "auto"
    """flash-attention where it runs (a CUDA GPU with flash-attn, a half precision, no ring), else SDPA."""
    EAGER = "eager"
    """transformers' eager attention: the b x a x s x s scores (and their softmax) are kept for backward."""
    SDPA = "sdpa"
    """torch's scaled_dot_product_attention (its flash, memory-efficient or cuDNN kernel on a GPU; a fused CPU one)."""
    FLASH = "flash"
    """The flash-attn package's FlashAttention-2 (CUDA, bf16/fp16)."""

    @property
    def keeps_scores(self) -> bool:
        """Whether the s x s attention scores are materialized and kept for backward (only eager's are: the fused
        kernels keep the log-sum-exp and recompute the scores)."""
        return self is Attention.EAGER

    @property
    def runs_ring(self) -> bool:
        """Whether context parallelism's ring attention can run on it: torch's ring dispatches SDPA's ops only
        (llmctl.engine.context_parallel); auto resolves to SDPA under a ring."""
        return self in (Attention.SDPA, Attention.AUTO)

    @property
    def needs_half(self) -> bool:
        """flash-attn has no fp32 kernel."""
        return self is Attention.FLASH

    @property
    def fixed(self) -> bool:
        """A kernel named by the user (not `auto`)."""
        return self is not Attention.AUTO

    @property
    def hf_name(self) -> str:
        """transformers' attn_implementation of the kernel (`auto` has none: the engine resolves it first)."""
        return {Attention.FLASH: "flash_attention_2"}.get(self, self.value)

    @classmethod
    def from_hf(cls, name: str) -> Attention:
        """The kernel of a transformers attn_implementation ("flash_attention_2" -> FLASH)."""
        return next(k for k in KERNELS if k.hf_name == name)


KERNELS: tuple[Attention, ...] = (Attention.EAGER, Attention.SDPA, Attention.FLASH)
"""The kernels themselves (what `auto` resolves to), slowest-memory first."""
FALLBACK: dict[Attention, Attention] = {Attention.FLASH: Attention.SDPA, Attention.SDPA: Attention.EAGER}
"""The next kernel down when a model class has no path for one (transformers' order)."""


def attention(value: str | Attention, allow_auto: bool = True) -> Attention:
    """The kernel of any spelling (any case), or one line naming the choices."""
    if isinstance(value, Attention) and (allow_auto or value.fixed):
        return value
    v = str(value).strip().lower()
    allowed = ("auto", *KERNELS) if allow_auto else KERNELS
    if v not in allowed:
        raise UnknownNameError(f"unknown attention {value!r}", hint="choose one of: " + ", ".join(allowed))
    return Attention(v)
