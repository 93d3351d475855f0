"""Activation-checkpointing modes: one spelling shared by the plan file, the memory model, the planner and the engine
(torch-free).

- `none`:       every decoder layer keeps what its ops save for backward.
- `selective`:  op-level selective checkpointing of every layer (torchtitan's `op` policy,
                torchtitan/models/llama3/infra/parallelize.py `_apply_ac_to_transformer_block`): the outputs of the
                attention kernel and of every other matmul are kept, everything else (the other matmuls, norms, rotary,
                activations, elementwise ops) is recomputed in backward.
- `partial:K`:  every K-th layer is checkpointed whole (torchtitan's layer-level `selective_ac_option: K`: layers
                K, 2K, 3K, ... counted from 1, so L // K of L layers); the others keep everything. K >= 2.
- `full`:       every layer is checkpointed whole: only its input is kept, its forward runs again in backward.
"""

from __future__ import annotations

import re

from llmctl.errors import UnknownNameError

MODES = ("none", "selective", "full")
"""The modes without a parameter; `partial:K` is the fourth."""
PLANNER_PARTIAL = (2, 3, 4)
"""Partial degrees the planner tries (half, a third and a quarter of the layers checkpointed)."""
MAX_PARTIAL = 1000
_PARTIAL = re.compile(r"^partial:(\d{1,6})$")
SPELLINGS = "none | selective | partial:K | full"


def parse(value: str) -> str:
    """The canonical spelling of a checkpointing mode, or UnknownNameError (one line naming the choices)."""
    v = str(value).strip().lower().replace("_", "-")
    if v in MODES:
        return v
    m = _PARTIAL.match(v)
    if m:
        k = int(m.group(1))
        if k == 1:
            raise UnknownNameError("checkpointing partial:1 checkpoints every layer", hint="write full")
        if 2 <= k <= MAX_PARTIAL:
            return f"partial:{k}"
        raise UnknownNameError(f"checkpointing partial:K needs 2 <= K <= {MAX_PARTIAL}, got {k}")
    raise UnknownNameError(f"unknown checkpointing {value!r}", hint=f"choose one of: {SPELLINGS}")


def partial_every(mode: str) -> int | None:
    """K of `partial:K`, else None."""
    return int(mode.split(":", 1)[1]) if mode.startswith("partial:") else None


def whole_layers(mode: str, num_layers: int) -> tuple[int, ...]:
    """0-based indices of the layers checkpointed whole (full: all, partial:K: K-1, 2K-1, ...)."""
    if mode == "full":
        return tuple(range(num_layers))
    k = partial_every(mode)
    if k:
        return tuple(i for i in range(num_layers) if (i + 1) % k == 0)
    return ()


def label(mode: str) -> str:
    """Words for explanations: 'no checkpointing', 'selective checkpointing', 'checkpointing 1 in 2 layers'."""
    if mode == "none":
        return "no checkpointing"
    if mode == "full":
        return "full checkpointing"
    k = partial_every(mode)
    if k:
        return f"checkpointing 1 in {k} layers"
    return f"{mode} checkpointing"
