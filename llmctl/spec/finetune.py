"""How the model is trained: every weight (full), or low-rank adapters on a frozen base (LoRA, Hu et al. 2021,
arXiv:2106.09685), or adapters on a 4-bit base (QLoRA, Dettmers et al. 2023, arXiv:2305.14314). Torch-free.

LoRA adds to each targeted linear W (out x in) two trainable matrices A (r x in) and B (out x r), B zero at the
start, and computes W x + (alpha / r) B A dropout(x) (peft's LoraLayer with its defaults: no bias, A drawn
kaiming-uniform, B zeros). Only A and B get gradients and optimizer states; the base stays frozen in the compute
dtype. Which linears a family targets by default is its registry entry's `lora_targets` (llmctl.families): the
attention and MLP projections, not the routed experts (transformers >= 5 keeps them as 3-D tensors, not linears),
nor the router, the embedding or the LM head.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator

from llmctl.bounds import GENERIC_FLOAT_LIMIT
from llmctl.errors import InputError, UnknownNameError
from llmctl.spec.decisions import decision
from llmctl.spec.fields import Float, Int, Text

if TYPE_CHECKING:
    from llmctl.spec.models import ModelSpec

METHODS = ("full", "lora", "qlora")
MAX_RANK = 65536
"""No published adapter is wider than the model (ranks of 8-256 are usual; Biderman et al. 2024 use up to 2048)."""
GATED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of a Llama-like block (transformers' module names; a shared expert's too)."""


def _lower(v: Any) -> Any:
    return v.strip().lower() if isinstance(v, str) else v


def check_target_list(targets: list[str]) -> list[str]:
    """A plan file's lora_targets, or ValueError (pydantic's one line): not empty, each a module name."""
    if not targets:
        raise ValueError("an empty list (leave it out for the family's default)")
    try:
        Finetune("lora", targets=tuple(targets))
    except InputError as e:
        raise ValueError(str(e)) from None
    return targets


@dataclass(frozen=True)
class Finetune:
    """The training method (plan file: the `finetune:` section)."""

    method: str = decision(
        "full",
        name="finetune",
        key="finetune.method",
        file_type=Annotated[Literal["full", "lora", "qlora"], BeforeValidator(_lower)],
        flag="--finetune",
        help="full (every weight trains) | lora (adapters on a frozen base in the compute dtype) | qlora (adapters on "
        "a frozen 4-bit NF4 base; torchao, bf16 or fp16).",
    )
    """full: every weight trains; lora: adapters on a frozen base in the compute dtype; qlora: adapters on a frozen
    4-bit NF4 base (torchao's NF4Tensor, llmctl/engine/qlora.py)."""
    rank: int = decision(
        16,
        name="lora_rank",
        key="finetune.lora_rank",
        file_type=Int,
        bounds={"ge": 1, "le": MAX_RANK},
        flag="--lora-rank",
        metavar="R",
        help="The adapters' rank r (with --finetune lora or qlora).",
    )
    alpha: float = decision(
        32.0,
        name="lora_alpha",
        key="finetune.lora_alpha",
        file_type=Float,
        bounds={"gt": 0, "le": GENERIC_FLOAT_LIMIT},
        flag="--lora-alpha",
        metavar="A",
        help="The adapters' alpha: their output is scaled by alpha / rank.",
    )
    dropout: float = decision(
        0.0,
        name="lora_dropout",
        key="finetune.lora_dropout",
        file_type=Float,
        bounds={"ge": 0, "lt": 1},
        help="Dropout on each adapter's input (peft's lora_dropout; 0 keeps no copy of the input).",
    )
    targets: tuple[str, ...] = decision(
        (),
        name="lora_targets",
        key="finetune.lora_targets",
        file_type=Annotated[list[Text], AfterValidator(check_target_list)] | None,
        file_default=None,
        to_file=lambda t: list(t) or None,
        to_setup=lambda v: tuple(v or ()),
        help="Module names that get adapters (peft's target_modules: the last part of the dotted name); none: the "
        "model family's default (attention and MLP projections).",
    )

    def __post_init__(self) -> None:
        m = self.method.strip().lower()
        if m not in METHODS:
            raise UnknownNameError(
                f"unknown fine-tuning method {self.method!r}", hint="choose one of: full, lora, qlora"
            )
        object.__setattr__(self, "method", m)
        if isinstance(self.rank, bool) or not 1 <= self.rank <= MAX_RANK:
            raise InputError(f"LoRA rank must be an integer in [1, {MAX_RANK}], got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise InputError(f"LoRA alpha must be a positive number, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise InputError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "targets", tuple(self.targets))
        for t in self.targets:
            if not t or not all(part.isidentifier() for part in t.split(".")):
                raise InputError(f"LoRA target {t!r} is not a module name (q_proj, mlp.down_proj, ...)")

    @property
    def adapters(self) -> bool:
        """Low-rank adapters on a frozen base (lora or qlora)."""
        return self.method != "full"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def label(self) -> str:
        return "full" if not self.adapters else f"{self.method} r{self.rank}"


FULL = Finetune()


def from_flags(values: Mapping[str, Any]) -> Finetune:
    """The training method of the commands' flags by decision name (finetune, lora_rank, lora_alpha), each bad value
    named by its flag (one line, exit 2)."""
    method = str(values.get("finetune", FULL.method)).strip().lower()
    rank, alpha = values.get("lora_rank", FULL.rank), values.get("lora_alpha", FULL.alpha)
    if method == "full" and (rank != FULL.rank or alpha != FULL.alpha):
        raise InputError("--lora-rank and --lora-alpha apply to adapters", hint="add --finetune lora (or qlora)")
    if isinstance(rank, bool) or rank < 1:
        raise InputError(f"--lora-rank must be a positive integer, got {rank}")
    if not alpha > 0:
        raise InputError(f"--lora-alpha must be a positive number, got {alpha}")
    return Finetune(method, rank, alpha)


def targets_for(spec: ModelSpec, finetune: Finetune) -> tuple[str, ...]:
    """The linears that get adapters: the plan's, else the model's family's default, else a Llama-like block's."""
    if finetune.targets:
        return finetune.targets
    family = spec.family
    return family.lora_targets if family is not None else GATED_TARGETS


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    """peft's rule for a list of target_modules: the module's dotted name equals a target or ends with "." + it."""
    return any(name == t or name.endswith("." + t) for t in targets)


def adapted_linears(spec: ModelSpec, targets: tuple[str, ...], index: int = 0) -> list[tuple[str, int, int]]:
    """(module name, in features, out features) of the linears of block `index` that get adapters: its 2-D weights
    (a GPT-2 Conv1D stores (in, out), a Linear (out, in)) whose module name matches a target."""
    out = []
    for name, shape in spec.layer_tensors(index):
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name.removesuffix(".weight")
        if _matches(module, targets):
            fan_in, fan_out = (shape[0], shape[1]) if spec.features.conv1d else (shape[1], shape[0])
            out.append((module, fan_in, fan_out))
    return out


def adapter_params(spec: ModelSpec, finetune: Finetune) -> int:
    """Trainable parameters of the adapters over the whole model: r x (in + out) per adapted linear per block."""
    if not finetune.adapters:
        return 0
    targets = targets_for(spec, finetune)
    total = 0
    firsts: dict[object, int] = {}
    for i, layer in enumerate(spec.layers):
        firsts.setdefault(layer, i)
    counts: dict[object, int] = {}
    for layer in spec.layers:
        counts[layer] = counts.get(layer, 0) + 1
    for layer, first in firsts.items():
        per = sum(finetune.rank * (fi + fo) for _, fi, fo in adapted_linears(spec, targets, first))
        total += per * counts[layer]
    return total


def targets_problem(spec: ModelSpec, finetune: Finetune) -> str | None:
    """Why the adapters' targets match no linear of the model (None: some do)."""
    if not finetune.adapters:
        return None
    targets = targets_for(spec, finetune)
    if any(adapted_linears(spec, targets, i) for i in range(min(spec.num_layers, 64))):
        return None
    return f"LoRA targets {', '.join(targets)} match no linear of {spec.name}'s blocks"
