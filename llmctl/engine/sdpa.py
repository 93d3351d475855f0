"""Which SDPA kernel the engine runs, chosen as the plan priced it, checked, and said in the start event.

PyTorch's SDPA picks a backend per call by its own priority order (a version's default, which has changed between
releases) among those whose constraints the inputs meet. The planner prices SDPA at one kernel's measured rate
(llmctl.spec.kernels.sdpa_kernel: cuDNN's attention on Hopper and Blackwell, FlashAttention-2 on the other sm80+ GPUs,
the memory-efficient kernel below them; on an H200 cuDNN ran 1.4-2.3x the flash backend,
docs/measurements/h200-kernels.json). So the engine puts that kernel first in SDPA's order for the whole run
(`sdpa_kernel(order, set_priority=True)`: every backend stays enabled, only the order changes), asks SDPA which one it
would run for the model's attention shapes and dtype (`torch._fused_sdp_choice`), and reports both; where the priced
kernel cannot run them (cuDNN on an unsupported head dimension, say) the run goes on with the next one and says so.

On a CPU, SDPA has its own kernels (a flash-style CPU kernel or the math path): nothing is chosen, the start event
says which one SDPA runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from llmctl.spec.kernels import architecture_of, sdpa_kernel

ORDER = ("cudnn", "fa2", "efficient", "math")
"""The fallbacks after the priced kernel, fastest first (the H100 and H200 kernel tables: cuDNN > FlashAttention-2 >
memory-efficient; math materializes the scores)."""
BACKEND_NAMES = {
    "cudnn": "CUDNN_ATTENTION",
    "fa2": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
"""Our kernel names (the planner's, llmctl.spec.kernels) -> torch.nn.attention.SDPBackend members."""


@dataclass(frozen=True)
class SdpaChoice:
    """What the start event says about SDPA: the kernel the plan priced, the order asked of SDPA, the kernel SDPA
    runs for this model's shapes, and why when the two differ (None: nothing to say)."""

    priced: str | None
    order: tuple[str, ...]
    runs: str
    why: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"priced": self.priced, "order": list(self.order), "runs": self.runs, "why": self.why}

    def words(self) -> str:
        """', SDPA kernel cudnn' for the start line on a GPU (', SDPA kernel fa2, not cudnn: why' where they differ);
        nothing on a CPU."""
        if self.priced is None:
            return ""
        return f", SDPA kernel {self.runs}" + (f", not {self.priced}: {self.why}" if self.why else "")


def order_for(priced: str) -> tuple[str, ...]:
    """The priced kernel first, then the rest of ORDER."""
    return (priced, *(k for k in ORDER if k != priced))


def decide(priced: str | None, order: tuple[str, ...], chosen: Callable[[tuple[str, ...]], str | None]) -> SdpaChoice:
    """The choice given `chosen(order)`: the kernel SDPA would run under that order (None: it cannot say)."""
    runs = chosen(order)
    if runs is None:
        return SdpaChoice(priced, order, priced or "unknown", "SDPA could not be asked which kernel it runs")
    if priced is not None and runs != priced:
        return SdpaChoice(
            priced, order, runs, f"the plan priced {priced}, which cannot run this model's attention here"
        )
    return SdpaChoice(priced, order, runs)


@dataclass(frozen=True)
class Layout:
    """A model's attention as SDPA sees it: heads, key/value heads, the query/key and value head dimensions, and the
    compute dtype (a torch.dtype)."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: Any


def sdp_choice(layout: Layout, device: Any) -> str | None:
    """The kernel SDPA runs, under the backend order now in effect, for a causal call of this layout (one sequence of
    256 tokens: SDPA's constraints are on head dims, dtype, GQA and alignment, not on the length); our kernel names,
    None when torch cannot say."""
    import torch

    names = {getattr(torch.nn.attention.SDPBackend, v): k for k, v in BACKEND_NAMES.items()}
    a = layout
    q = torch.empty(1, a.heads, 256, a.head_dim, dtype=a.dtype, device=device)
    k = torch.empty(1, a.kv_heads, 256, a.head_dim, dtype=a.dtype, device=device)
    v = torch.empty(1, a.kv_heads, 256, a.v_head_dim, dtype=a.dtype, device=device)
    try:
        picked = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=a.kv_heads != a.heads)
    except (RuntimeError, TypeError, AttributeError):
        return None
    return names.get(torch.nn.attention.SDPBackend(picked))


@contextlib.contextmanager
def ordered(order: tuple[str, ...]) -> Iterator[None]:
    """SDPA's backend priority set to `order` for the block (all of them enabled), restored after."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as torch_sdpa_kernel

    with torch_sdpa_kernel([getattr(SDPBackend, BACKEND_NAMES[k]) for k in order], set_priority=True):
        yield


def choose(device: Any, attn_impl: str, layout: Layout) -> SdpaChoice:
    """The SDPA choice of a run on `device` (a torch.device) with transformers' attention `attn_impl`: on CUDA, the
    priced kernel first and SDPA asked under that order; on a CPU, what SDPA runs by itself; not SDPA, None's."""
    if attn_impl != "sdpa":
        return SdpaChoice(None, (), attn_impl)
    if device.type != "cuda":
        runs = sdp_choice(layout, device)
        cpu = {"fa2": "flash", "math": "math"}.get(runs or "", runs or "unknown")  # its flash-style CPU kernel, or math
        return SdpaChoice(None, (), f"cpu-{cpu}")
    import torch

    capability = torch.cuda.get_device_capability(device)
    priced = sdpa_kernel(architecture_of(capability), flash_attention=capability >= (8, 0))
    order = order_for(priced)

    def under(o: tuple[str, ...]) -> str | None:
        with ordered(o):
            return sdp_choice(layout, device)

    return decide(priced, order, under)


def for_run(device: Any, attn_impl: str, attention: Any, setup: Any, say: bool) -> SdpaChoice:
    """The choice of a run: the first block's attention (a llmctl.spec.layers attention: TP's heads per rank) in the
    setup's compute dtype; a differing kernel logged as a warning where `say` (rank 0)."""
    import logging

    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setup.precision.compute_dtype, torch.float32)
    tp = setup.tp
    layout = Layout(
        max(1, attention.num_heads // tp),
        max(1, attention.num_kv_heads // tp),
        attention.head_dim,
        attention.v_head_dim,
        dtype,
    )
    choice = choose(device, attn_impl, layout)
    if choice.why and say:
        logging.getLogger("llmctl.engine").warning(
            "attention: SDPA runs %s, not %s: %s", choice.runs, choice.priced, choice.why
        )
    return choice


@contextlib.contextmanager
def applied(choice: SdpaChoice) -> Iterator[None]:
    """The run's SDPA order in effect for the block (training, evaluation, compilation's tracing); nothing on a CPU
    or without SDPA."""
    if not choice.order:
        yield
        return
    with ordered(choice.order):
        yield
