"""`python -m llmctl.engine PLAN.yaml`: run a plan on this rank (under torchrun, or as one plain process).

Errors are one line on stderr and an exit code (2 bad input, 1 runtime), never a traceback; LLMCTL_DEBUG=1
re-raises. The plan is validated before torch is imported, so a bad plan fails in a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from llmctl.errors import InputError, LlmctlError

USAGE = "usage: python -m llmctl.engine PLAN.yaml   (or: torchrun --nproc_per_node N -m llmctl.engine PLAN.yaml)"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    logging.basicConfig(
        level=logging.INFO if _rank() == 0 else logging.WARNING,
        format=f"[llmctl.engine rank{_rank()}] %(message)s",
        stream=sys.stderr,
    )
    try:
        if len(args) != 1:
            raise InputError(f"expected one plan file, got {len(args)} arguments", hint=USAGE)
        from llmctl.spec.planfile import load_plan

        plan = load_plan(args[0])
        from llmctl.engine.loop import run

        run(plan)
    except LlmctlError as e:
        if os.environ.get("LLMCTL_DEBUG") == "1":
            raise
        # Bad input is the same on every rank: say it once. Runtime failures may be rank-specific: every rank.
        if _rank() == 0 or not isinstance(e, InputError):
            prefix = f"[rank {_rank()}] " if _rank() else ""
            print(f"llmctl: error: {prefix}{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("llmctl: error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # Out of memory is a planning problem, not a bug: one line and what to change. Anything else is a bug
        # or a hardware fault, and its traceback (recorded by torchrun too) is what one needs to fix it.
        if type(e).__name__ != "OutOfMemoryError" or os.environ.get("LLMCTL_DEBUG") == "1":
            raise
        print(
            f"llmctl: error: [rank {_rank()}] out of memory: {str(e).splitlines()[0]} (lower "
            "training.micro_batch_size, or set training.activation_checkpointing: full)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
