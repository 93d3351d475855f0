"""Numbers at the boundary: every integer or float option of every command is finite and within a documented
range, checked while the command line is parsed (click's one-line usage error, exit 2), before any command code
runs. Applied to the options of each command as it is resolved (`llmctl.cli.main`), so that an option added
later is covered without a line here; `LIMITS` only tightens the generic bounds for options whose real-world
range is known. The commands' own checks (positive, a fraction, divides the world size) come after these.
Torch-free."""

from __future__ import annotations

import math
import typing
from typing import Any

# Past these no real cluster or model goes (checked once, with one clear line, instead of a planner searching
# 10^20 nodes): the largest published training clusters have ~100k GPUs (12.5k 8-GPU nodes), the longest
# published context windows are 10M tokens (Llama 4 Scout), and the largest global batches are ~16-60M tokens.
LIMITS: dict[str, float] = {
    "--gpus": 1_000_000,
    "--nodes": 100_000,
    "--nnodes": 100_000,
    "--node-rank": 100_000,
    "--gpus-per-node": 1024,
    "--nproc-per-node": 1024,
    "--tp": 4096,
    "--cp": 4096,
    "--pp": 4096,
    "--ep": 4096,
    "--seq-len": 10_000_000,
    "--loss-chunk": 10_000_000,
    "--micro-batch": 1_000_000,
    "--grad-accum": 1_000_000,
    "--global-batch": 100_000_000,
    "--global-batch-tokens": 10**12,
    "--inter-gbps": 1_000_000,  # Gbit/s per node: 1 Pbit/s
    "--intra-gbps": 1_000_000,
    "--expect-gbps": 1_000_000,
    "--price": 1_000_000,  # $ per GPU-hour
    "--cuda-context-gib": 1024,
    "--iters": 1_000_000,
    "--warmup": 1_000_000,
    "--max-pair-rounds": 1_000_000,
    "--top": 100_000,
    "--timeout": 7 * 86400,  # seconds
    "--signal-lead": 7 * 86400,  # seconds
    "--master-port": 65535,
    "--lora-rank": 65536,  # llmctl.spec.finetune.MAX_RANK
}
# Any other number: an integer that a float holds exactly, a float of a magnitude no quantity here reaches.
GENERIC_INT_LIMIT = 2**53
GENERIC_FLOAT_LIMIT = 1e15


def _kind(param: Any) -> type | None:
    """int or float for a numeric option (Optional[...] included), else None."""
    descriptor = getattr(param, "type_descriptor", None)
    annotation = getattr(descriptor, "annotation", None)
    args = typing.get_args(annotation) or (annotation,)
    for kind in (float, int):
        if kind in args:
            return kind
    return None


def check(flag: str, kind: type, value: Any) -> None:
    """Raise ValueError with the message for a number out of bounds (None and lists are checked element-wise)."""
    if value is None:
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            check(flag, kind, v)
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a finite number")
    limit = LIMITS.get(flag, GENERIC_INT_LIMIT if kind is int else GENERIC_FLOAT_LIMIT)
    if abs(value) > limit:
        shown = f"{int(limit):,}" if float(limit).is_integer() else f"{limit:g}"
        raise ValueError(f"{value} is out of range: at most {shown}" + (" in magnitude" if value < 0 else ""))


def bound_numbers(command: Any, bad_parameter: type[Exception]) -> None:
    """Give every numeric option of `command` the check above, before its own callback (once per command)."""
    if getattr(command, "_llmctl_bounded", False):
        return
    for param in getattr(command, "params", []):
        kind = _kind(param)
        if kind is None:
            continue
        flag = max(getattr(param, "opts", []) or [param.name], key=len)
        previous = param.callback

        def callback(ctx: Any, p: Any, value: Any, flag: str = flag, kind: type = kind, previous: Any = previous):
            try:
                check(flag, kind, value)
            except ValueError as e:
                raise bad_parameter(str(e), ctx=ctx, param=p) from None
            return previous(ctx, p, value) if previous is not None else value

        param.callback = callback
    command._llmctl_bounded = True
