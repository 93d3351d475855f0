"""The entry one rank runs (`python -m llmctl.engine PLAN` under torchrun): the process group around a Trainer.

The stop signal is installed first, the Trainer (llmctl.engine.trainer) picks the device and kernels, then the process
group comes up, the Trainer sets up and trains, and all ranks leave together.
"""

from __future__ import annotations

from typing import Any

from llmctl.engine import sdpa
from llmctl.engine.checkpoint import StopSignal
from llmctl.engine.trainer import RankEnv, Trainer
from llmctl.engine.watchdog import collective_failure, flight_recorder_env
from llmctl.spec.planfile import Plan


def init_distributed(env: RankEnv, backend: str, timeout_s: float | None = None) -> None:
    """The process group; `timeout_s`: how long a collective may wait (the plan's watchdog), else torch's default."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    kw: dict[str, Any] = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    if env.under_torchrun:
        # On CUDA also a gloo backend for CPU tensors (the stop-flag agreement must not sync the GPU).
        dist.init_process_group(backend="cuda:nccl,cpu:gloo" if backend == "nccl" else "gloo", **kw)
    else:  # one plain process: a world of one, no rendezvous needed
        dist.init_process_group(
            backend="cuda:nccl,cpu:gloo" if backend == "nccl" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            **kw,
        )


def run(plan: Plan) -> dict[str, Any]:
    """Train per the plan on this rank. Returns a summary (last step, losses seen, why it stopped)."""
    import torch.distributed as dist

    env = RankEnv.from_environ()
    # Installed first: a preemption signal during start-up then stops the run at its first step boundary.
    stop = StopSignal()
    stop.install()
    trainer = Trainer(plan, env, stop)
    timeout = plan.watchdog.timeout_s(plan.predicted.step_time_s)
    flight_recorder_env(plan.logging.dir, trainer.choice.backend)
    init_distributed(env, trainer.choice.backend, timeout)
    finished = False
    try:
        trainer.setup()
        with sdpa.applied(trainer.sdpa):  # the attention kernel the plan priced, first in SDPA's order
            summary = trainer.train()
        finished = True
        return summary
    except RuntimeError as e:  # a collective that timed out or lost its peer: one line, not a traceback per rank
        failure = collective_failure(e, env.rank, trainer.watch.where(), timeout)
        if failure is None:
            raise
        trainer.watch.dump_flight()  # which collective, and who did not enter it: `llmctl status` reads it
        raise failure from None
    finally:
        trainer.watch.close()
        if dist.is_initialized() and finished:
            # All ranks leave together: tearing gloo down while a peer's last collective (or a sub-group of the
            # 2-D mesh) is still in flight can abort a rank ("terminate called without an active exception",
            # seen once on a 2x2 HYBRID run). On an error path neither barrier nor destroy: a peer may never
            # arrive, and destroy can then deadlock (torchtitan#1342 does the same); the process exits anyway.
            dist.barrier()
            dist.destroy_process_group()
