"""Several plans through the engine's entry point in one torchrun (`torchrun --nproc_per_node N engine_runs.py OUT.json
PLAN...`): `llmctl.engine.__main__.main([PLAN])`, what `python -m llmctl.engine PLAN` runs (the plan file, the spec,
the build, FSDP2, data, the training loop, metrics.jsonl), plan after plan.

Starting a torchrun costs ~10 s of CPU on the test machine (torch and transformers imported by the agent and each
rank), a tiny plan about a second: tests that need several uninterrupted runs make them here. The engine
destroys its process group at the end of a run, so each plan gets a new one, on torchrun's store under a prefix of
its own. What one torchrun per plan does besides (the group from torchrun's environment, a fresh process, the exit
through os._exit) is checked by the tests that run `torchrun -m llmctl.engine PLAN` (tests/engine/conftest.py's
run_engine). Process-wide peaks (the start event's resident memory) include the plans run before.

A plan for fewer ranks than the launch has runs on the first ones, with the environment torchrun would give them
(WORLD_SIZE), while the others wait. Rank 0 writes {PLAN: {"code": the highest exit code of main over the ranks,
"log": the engine's log messages on rank 0}} to OUT.json after each plan (merged into what OUT.json already holds).
A plan that fails ends the launch: a peer may still be waiting in one of its collectives.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from llmctl.engine.__main__ import main as engine_main
from llmctl.spec.planfile import load_plan


class _Messages(logging.Handler):
    """The messages the engine logs during one run (rank 0 logs INFO, the other ranks WARNING)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def finish(code: int) -> None:
    """Exit without the interpreter's teardown, as the engine's __main__ does (gloo's C++ objects destroyed in no
    fixed order now and then abort a finished rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _ranks(plan: str, world: int) -> int:
    """How many ranks the plan is for (hardware.nodes x nproc_per_node); the launch's world when the plan cannot be
    read or asks for more (the engine then says why, as one process per plan would)."""
    try:
        n = load_plan(plan).world_size
    except Exception:  # noqa: BLE001 - a bad plan: the engine's main reports it
        return world
    return n if 0 < n <= world else world


def run_plans(plans: list[str], store: Any, rank: int, world: int, out: Path) -> None:
    """Run each plan through the engine's main, in a new process group on `store`, on the first ranks of the launch
    (as many as the plan is for, with the environment torchrun gives a world of that size; the other ranks wait);
    rank 0 records the results in `out`. Ends the process when a plan fails."""
    results: dict[str, Any] = json.loads(out.read_text()) if rank == 0 and out.exists() else {}
    log = logging.getLogger("llmctl.engine")
    environ = dict(os.environ)
    for i, plan in enumerate(plans):
        prefix, n = f"engine-run-{i}/", _ranks(plan, world)
        code, messages = 0, _Messages()
        if rank < n:
            os.environ.update(WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n if n < world else environ["LOCAL_WORLD_SIZE"]))
            dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=n)
            log.addHandler(messages)
            try:
                code = engine_main([plan])
            except BaseException:  # noqa: BLE001 - a bug (main re-raises it): its traceback, and the plan failed
                traceback.print_exc()
                code = 1
            finally:
                log.removeHandler(messages)
                os.environ.update(environ)
        # Every rank says how its run ended; one that finished waits for the others' word (a rank that failed may
        # have left its run before the others finished it), one that failed leaves at once (its peers may be
        # waiting for it in a collective: torchrun stops them when it exits).
        store.set(f"{prefix}code/{rank}", str(code))
        if code == 0:
            code = max(int(store.get(f"{prefix}code/{r}")) for r in range(world))
        if rank == 0:
            results[plan] = {"code": code, "log": messages.messages}
            out.write_text(json.dumps(results))
        if code != 0 or dist.is_initialized():  # a run that ended without its closing barrier: not in step
            finish(1)


def main() -> None:
    out, plans = Path(sys.argv[1]), sys.argv[2:]
    store, rank, world = next(dist.rendezvous("env://"))
    run_plans(plans, store, rank, world, out)
    finish(0)


if __name__ == "__main__":
    main()
