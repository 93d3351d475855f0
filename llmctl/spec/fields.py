"""The plan file's value types (pydantic annotations, torch-free): what a key may hold, shared by the decisions the
setup declares (llmctl.spec.setup) and the plan file's own keys (llmctl.spec.planfile).

Every Int and Float field states both bounds (tests/cli/test_fuzz_planfile.py checks it): its own cap, else the
command line's generic one. `Int` and `Float` carry no bounds themselves (pydantic lets an alias's Field bounds replace
the field's own): a field gives them (a decision's `bounds`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from llmctl.errors import LlmctlError
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.optimizer_states import canonical_states
from llmctl.spec.parallel import ENGINE_STRATEGIES, canonical_strategy
from llmctl.spec.pipeline import schedule
from llmctl.spec.precision import PRECISION_HELP, policy
from llmctl.spec.text import check_line

MAX_TEXT = 4096
"""PATH_MAX on Linux (limits.h): no path, and so no name or field of a plan, is longer."""


def not_a_boolean(value: Any) -> Any:
    # YAML reads yes/no/true/false/on/off as booleans and pydantic's lax mode would take them as 1/0: `nodes: yes`
    # is a slip, not one node.
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
    return value


def no_nul(value: str, where: str = "") -> str:
    if "\x00" in value:
        raise ValueError(f"{where + ': ' if where else ''}contains a NUL byte (\\x00), which no path or name can hold")
    return value


Int = Annotated[int, BeforeValidator(not_a_boolean)]
"""An integer, never a boolean."""
Float = Annotated[float, BeforeValidator(not_a_boolean)]
"""A finite float (the models' allow_inf_nan=False), never a boolean."""
Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT), AfterValidator(check_line)]
"""A name or path: not empty (an empty path would silently mean the current folder), one line of printable text (no
control character: llmctl.spec.text), at most PATH_MAX."""


def _as(parse: Any, expected: str) -> Any:
    """A before-validator from a parser of the library (one LlmctlError line -> pydantic's ValueError)."""

    def validate(v: Any) -> Any:
        if not isinstance(v, str):
            raise ValueError(f"expected {expected}")
        try:
            return parse(v)
        except LlmctlError as e:
            raise ValueError(str(e)) from None

    return validate


def _strategy(v: Any) -> Any:
    if not isinstance(v, str):
        return v
    try:
        return canonical_strategy(v, ENGINE_STRATEGIES)
    except LlmctlError as e:
        raise ValueError(str(e)) from None


def _states(v: Any) -> Any:
    if not isinstance(v, str):
        return v
    try:
        return canonical_states(v)
    except LlmctlError as e:
        raise ValueError(str(e)) from None


Sharding = Annotated[Literal["full_shard", "hybrid_shard", "no_shard"], BeforeValidator(_strategy)]
"""llmctl.spec.parallel.ENGINE_STRATEGIES; older plans' `full` and `hybrid` are read as these."""
Precision = Annotated[str, BeforeValidator(_as(lambda v: policy(v).name, "a precision name (" + PRECISION_HELP + ")"))]
"""Any name or alias llmctl.spec.precision accepts, stored as the policy's own name (`fp16` -> fp16-mixed)."""
AttentionName = Literal["auto", "flash", "sdpa", "eager"]
PipelineSchedule = Annotated[
    str, BeforeValidator(_as(lambda v: str(schedule(v)), "a pipeline schedule (1f1b, interleaved-1f1b, zbv, gpipe)"))
]
"""llmctl.spec.pipeline's schedules, stored as our name (torch's `Interleaved1F1B` -> interleaved-1f1b)."""
Checkpointing = Annotated[str, BeforeValidator(_as(ckpt_modes.parse, f"one of {ckpt_modes.SPELLINGS}"))]
"""llmctl.spec.checkpointing: none | selective | partial:K | full."""
States = Annotated[Literal["auto", "fp32", "bf16", "8bit"], BeforeValidator(_states)]
Beta = Annotated[float, BeforeValidator(not_a_boolean), Field(ge=0, lt=1)]
"""An Adam moment decay: torch.optim.AdamW refuses one outside [0, 1)."""
