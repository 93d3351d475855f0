"""What Adam's two moments (exp_avg, exp_avg_sq) are stored in: a memory lever the planner uses only when asked
(torch-free).

`auto` is the precision policy's own `optimizer_state_dtype` (fp32 under the mixed precisions, bf16 under pure bf16),
so a setup that does not ask changes nothing. The others, asked for with `--optimizer-states` or the plan file's
`optimizer.states`:

- fp32: 4 + 4 bytes a parameter (torch's fused AdamW; over pure-bf16 weights, llmctl.engine.adamw_states'
  MomentsAdamW).
- bf16: 2 + 2 bytes a parameter: MomentsAdamW, which does the step's math in fp32 and rounds the moments to bf16
  (round to nearest) when it stores them.
- 8bit: torchao's AdamW8bit (torchao/optim/subclass_8bit.py), block-wise dynamic quantization (Dettmers et al.
  2022): each moment of a quantized tensor is one uint8 code a value, one fp32 scale per block of 256 values and its
  own 256-entry fp32 code book (`qmap`); tensors under 4,096 values, or not a whole number of blocks, stay in the
  parameter's dtype (`quantized`). The rule is torchao's `_AdamBase._new_buffer`, applied to each rank's local shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.errors import UnknownNameError

AUTO = "auto"
OPTIMIZER_STATES: tuple[str, ...] = (AUTO, "fp32", "bf16", "8bit")
ALIASES: dict[str, str] = {
    "float32": "fp32",
    "32": "fp32",
    "bfloat16": "bf16",
    "8-bit": "8bit",
    "int8": "8bit",
    "uint8": "8bit",
}
HELP = "auto (the precision's own: fp32 under mixed precision) | fp32 | bf16 | 8bit (torchao AdamW8bit)"
"""The one --optimizer-states help text (estimate-memory, plan)."""

# torchao 0.18 torchao/optim/adam.py (AdamW8bit's default block_size, and _AdamBase._new_buffer: "follow
# bitsandbytes, only quantize tensors >= 4096 values", and only a whole number of blocks) and subclass_8bit.py
# (OptimState8bit.zeros: uint8 codes shaped like the tensor, numel // block_size fp32 scales, and a 256-entry fp32
# qmap made per state tensor by create_dynamic_map).
BLOCK_SIZE_8BIT = 256
MIN_NUMEL_8BIT = 4096
QMAP_BYTES_8BIT = 256 * 4


@dataclass(frozen=True)
class StatesKind:
    name: str
    label: str
    """How the ledger line names it."""
    caveat: str | None
    """What it may cost in convergence, with its source; None for fp32 (the reference)."""


KINDS: dict[str, StatesKind] = {
    k.name: k
    for k in (
        StatesKind("fp32", "fp32", None),
        StatesKind(
            "bf16",
            "bf16",
            "bf16 moments, rounded to nearest when stored: DeepSeek-V3 kept AdamW's moments in bf16 over fp32 "
            "master weights 'without incurring observable performance degradation' (arXiv 2412.19437, sec. 3.3.3); "
            "but a stored value moves only by more than half of bf16's spacing (0.2-0.4% of it), as nearest "
            "rounding cancels small weight updates (Zamirai et al. 2020, https://arxiv.org/abs/2010.06192): under "
            "beta2 0.999 exp_avg_sq decays 0.1% a step and so never decreases (llmctl's default beta2 is 0.95). "
            "Compare the loss curve with an fp32-state run",
        ),
        StatesKind(
            "8bit",
            "8-bit block-wise",
            "8-bit block-wise Adam matched 32-bit Adam on language-model pretraining up to 1.5B parameters with the "
            "same hyperparameters (Dettmers et al. 2022, '8-bit Optimizers via Block-wise Quantization', "
            "https://arxiv.org/abs/2110.02861), with a 'stable embedding' layer these models do not have; torchao's "
            "AdamW8bit fine-tuning Llama-2-7B scored 41.50 on truthfulqa_mc2 vs 42.61 for torch's fused AdamW, both "
            "in full bf16 (torchao/optim/README.md). Compare the loss curve with an fp32-state run",
        ),
    )
}


def canonical_states(name: str) -> str:
    """The one spelling of an optimizer-states name (any case, `_` for `-`), or one line naming the choices."""
    v = str(name).strip().lower().replace("_", "-")
    v = ALIASES.get(v, v)
    if v not in OPTIMIZER_STATES:
        raise UnknownNameError(
            f"unknown optimizer states {name!r}", hint="choose one of: " + ", ".join(OPTIMIZER_STATES)
        )
    return v


def quantized(numel: int) -> bool:
    """Whether torchao's AdamW8bit keeps a tensor of `numel` (local) values in 8 bits (else in its own dtype)."""
    return numel >= MIN_NUMEL_8BIT and numel % BLOCK_SIZE_8BIT == 0


def adam_8bit_bytes(numel: int, fallback_bytes: int) -> int:
    """Bytes of AdamW8bit's two moments for one (local) tensor of `numel` values whose own dtype has
    `fallback_bytes` a value: per moment, codes + scales + qmap when quantized, else a plain tensor like it."""
    if not numel:
        return 0
    if quantized(numel):
        return 2 * (numel + 4 * (numel // BLOCK_SIZE_8BIT) + QMAP_BYTES_8BIT)
    return 2 * numel * fallback_bytes


def caveat_note(asked: str) -> str | None:
    """The line estimate-memory and plan print when --optimizer-states asked for smaller moments: the convergence
    caveat with its source; None when nothing was asked (auto) or fp32 was."""
    caveat = KINDS[asked].caveat if asked != AUTO else None
    return f"--optimizer-states {asked}: {caveat}" if caveat else None
