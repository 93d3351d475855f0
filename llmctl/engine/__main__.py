"""`python -m llmctl.engine PLAN.yaml`: run a plan on this rank (under torchrun, or as one plain process).

Errors are one line on stderr and an exit code (2 bad input, 1 runtime, out of memory included), through
`llmctl.errors.report`; only a bug keeps its traceback. The plan is validated before torch is imported, so a bad plan fails in a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from llmctl.errors import InputError, report

USAGE = (
    "usage: python -m llmctl.engine PLAN.yaml   (or: torchrun --nproc_per_node N -m llmctl.engine PLAN.yaml)\n"
    "       python -m llmctl.engine --dry-start [--allocate-all] [--json-out FILE] PLAN.yaml   (setup of rank 0 only)"
)


def _dry_start(args: list[str]) -> int:
    """--dry-start: rank 0's setup in this process; the report as JSON (to --json-out, else stdout)."""
    import json

    from llmctl.fileio import write_atomic
    from llmctl.spec.planfile import load_plan

    allocate_all = "--allocate-all" in args
    args = [a for a in args if a != "--allocate-all"]
    out = None
    if "--json-out" in args:
        i = args.index("--json-out")
        if i + 1 >= len(args):
            raise InputError("--json-out needs a file name", hint=USAGE)
        out = args[i + 1]
        del args[i : i + 2]
    if len(args) != 1 or args[0].startswith("-"):
        raise InputError(f"--dry-start expects one plan file, got {args}", hint=USAGE)
    plan = load_plan(args[0])
    from llmctl.engine.dryrun import dry_start

    report = json.dumps(dry_start(plan, allocate_all=allocate_all), indent=1)
    if out:
        write_atomic(out, report + "\n")
    else:
        print(report)
    return 0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@contextmanager
def _owning(run_dir: str, checkpoint_dir: str) -> Iterator[None]:
    """Rank 0 holds the run folder's lock (llmctl.launch.runlock) from before anything is written there until the
    run ends, unless `llmctl launch` holds it; a second run on the same folder stops here with one line naming the
    holder (exit 2). Released on leaving, so that one process may run plans one after another."""
    from llmctl.launch import runlock

    lock = runlock.for_engine(run_dir, checkpoint_dir, _rank())
    for warning in lock.warnings if lock is not None else []:
        logging.getLogger("llmctl.engine").warning("warning: %s", warning)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


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
    # torchao (float8, low-bit optimizers; transformers imports it where installed) logs every CUDA extension it cannot
    # load: noise on a CPU machine, and nothing llmctl uses.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's enums, registered the old way
    from llmctl.measure import fake

    fake.install()  # a model type outside the analytical families is measured (cached: `llmctl plan` measured it)
    try:
        if args and args[0] == "--dry-start":
            return _dry_start(args[1:])
        if len(args) != 1:
            raise InputError(f"expected one plan file, got {len(args)} arguments", hint=USAGE)
        from llmctl.spec.planfile import load_plan

        plan = load_plan(args[0])
        with _owning(plan.logging.dir, plan.checkpoint.dir):
            from llmctl.engine.loop import run

            run(plan)
    except BaseException as e:
        if not isinstance(e, Exception | KeyboardInterrupt):
            raise  # SystemExit and friends
        # Bad input is the same on every rank: say it once. Runtime failures may be rank-specific: every rank.
        # A bug re-raises: its traceback (recorded by torchrun too) is what one needs to fix it.
        return report(e, rank=_rank(), say=_rank() == 0 or not isinstance(e, InputError), reraise_bugs=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: with the process group already destroyed (loop.run), tearing down
    # torch's C++ state now and then aborts a finished rank ("terminate called without an active exception",
    # SIGABRT, ~1-3% of gloo runs on a loaded 2-core machine), turning a complete run into torchrun's exit 1. Every
    # file the run writes is closed by then; flush what Python still buffers and exit with the run's code.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
