"""`llmctl tune`: run the planner's best few setups for a few steps each on this machine and keep the one that is
measured fastest; write it as a plan, and the figures as a calibration file that `llmctl plan --calibrate` reads.

This module parses the options and renders; the workflow is llmctl.tune (llmctl.tune.workflow: the starting point,
the pool and picks, the trials locally or in one SLURM allocation, the report and the files written).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from llmctl.cli.options import JsonOpt
from llmctl.cli.tune_show import Progress, show
from llmctl.errors import InputError
from llmctl.spec import planfile as pf
from llmctl.tune import space as tune_space
from llmctl.tune import workflow
from llmctl.tune.run import say

DEFAULT_DIR = workflow.DEFAULT_DIR
MODEL_OPTIONS = (*workflow.PLAN_OPTIONS, *workflow.DECISION_OPTIONS)
"""The plan options `tune MODEL` takes, declared once in `llmctl plan` (its signature is copied below): its own and
the decisions' flags but those tune tries as lists (llmctl.tune.workflow.OWN_DECISIONS)."""


def tune_command(
    target: Annotated[
        Optional[str],
        typer.Argument(
            help="A plan file (PLAN.yaml, as `llmctl plan` writes it), or a MODEL as `llmctl plan` takes it (then "
            "the plan options below apply and tuning starts from the plan it would write).",
            metavar="PLAN.yaml|MODEL",
            show_default=False,
        ),
    ] = None,
    top: Annotated[
        int,
        typer.Option(
            "--top",
            help="Trials (K): the predicted best, then the best setup differing from it only in micro-batch, "
            "only in checkpointing, only in compile, only in strategy, then the next best.",
        ),
    ] = tune_space.DEFAULT_TOP,
    steps: Annotated[int, typer.Option("--steps", help="Measured steps per trial.")] = tune_space.DEFAULT_STEPS,
    warmup: Annotated[
        int, typer.Option("--warmup", help="Steps each trial runs before measuring (compile, allocator, caches).")
    ] = tune_space.DEFAULT_WARMUP,
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds",
            help="Run the K trials this many times, one after another each time; the figures are medians over all "
            "rounds (a shared machine's speed drifts: this spreads the drift over every trial alike).",
        ),
    ] = 1,
    strategy: Annotated[
        Optional[str],
        typer.Option("--strategy", help="Strategies to try, comma-separated (default: those the engine runs here)."),
    ] = None,
    micro_batch: Annotated[
        Optional[str],
        typer.Option(
            "--micro-batch",
            help="Micro-batches to try, comma-separated; accumulation keeps the global batch (default: every divisor "
            "of the per-rank batch).",
        ),
    ] = None,
    checkpointing: Annotated[
        Optional[str],
        typer.Option(
            "--checkpointing",
            help="Checkpointing modes to try, comma-separated: none, selective, partial:K, full (default: the "
            "planner's modes).",
        ),
    ] = None,
    compile_: Annotated[
        Optional[bool],
        typer.Option(
            "--compile/--no-compile", help="Pin torch.compile on or off (default: try both).", show_default=False
        ),
    ] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="Where to write the measured-best plan.")] = "plan.yaml",
    calibration_out: Annotated[
        Optional[str],
        typer.Option(
            "--calibration", help="Where to write the calibration file (default: beside the plan, NAME.tune.json)."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing plan or calibration file.")] = False,
    json_out: JsonOpt = False,
    tune_dir: Annotated[
        Optional[str], typer.Option("--dir", help=f"Where trial folders go (default ./{DEFAULT_DIR}).")
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Seconds one trial may run before it is stopped and marked failed.")
    ] = 3600.0,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Run the trials in one SLURM allocation of the plan's nodes (sbatch; the SLURM options below), one "
            "after another; this command follows the job and reports as for local trials.",
        ),
    ] = False,
    **plan_options: Any,
) -> None:
    """Which of the planner's best setups is really fastest here? Runs each for a few steps (local torchrun, or one
    SLURM allocation with --slurm) and writes the measured best as a plan, with a calibration file for
    `llmctl plan --calibrate`."""
    from llmctl.launch.slurm_options import SlurmOptions

    slurm_values = {k: plan_options.pop(k) for k in SlurmOptions.names() if k in plan_options}
    if not slurm and (given_slurm := SlurmOptions.given_flags(slurm_values)):
        raise InputError(f"{', '.join(given_slurm)}: SLURM options apply with --slurm")
    target = _checked(target, plan_options, top, steps, warmup, rounds, timeout)
    out = Path(output)
    request = workflow.TuneRequest(
        target=target,
        plan_options=plan_options,
        given=tuple(n for n in MODEL_OPTIONS if _given(n, plan_options)),
        pins=_pins(strategy, micro_batch, checkpointing),
        compile=compile_,
        top=top,
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        output=out,
        calibration_out=Path(calibration_out) if calibration_out else out.with_name(out.stem + ".tune.json"),
        force=force,
        tune_dir=tune_dir,
        timeout_s=timeout,
        slurm=slurm_values if slurm else None,
    )
    outcome = workflow.tune(request, Progress, say)
    show(outcome.report, outcome.data, json_out, outcome.written)
    if outcome.written is None:
        raise workflow.all_failed(outcome)


# --- parsing -----------------------------------------------------------------------------------------------------------
def _checked(
    target: str | None, plan_options: dict[str, Any], top: int, steps: int, warmup: int, rounds: int, timeout: float
) -> str:
    """The target, once it and the counts are checked: one line naming the first bad one (exit 2)."""
    for flag, v, least in (("--top", top, 1), ("--steps", steps, 1), ("--warmup", warmup, 0), ("--rounds", rounds, 1)):
        if v < least:
            raise InputError(f"{flag} must be >= {least}, got {v}")
    if steps + warmup > pf.MAX_STEPS:
        raise InputError(f"--steps + --warmup must be at most {pf.MAX_STEPS:,}, got {steps + warmup:,}")
    if not timeout > 0:
        raise InputError(f"--timeout must be a positive number of seconds, got {timeout}")
    if target is None and plan_options.get("params"):
        raise InputError("--params gives no architecture for the engine to run", hint="pass a preset or a config.json")
    if target is None:
        raise InputError(
            "no plan file or model given", hint="llmctl tune PLAN.yaml, or llmctl tune MODEL --gpu KIND ..."
        )
    return target


def _given(name: str, options: dict[str, Any]) -> bool:
    default = _PLAN_DEFAULTS.get(name)
    return options.get(name) is not None and options.get(name) != default


def _pins(strategy: str | None, micro_batch: str | None, checkpointing: str | None) -> dict[str, list[Any] | None]:
    mbs = None
    if micro_batch is not None:
        mbs = []
        for part in _split(micro_batch, "--micro-batch"):
            if not part.isdigit() or int(part) < 1:
                raise InputError(f"--micro-batch {micro_batch!r}: expected positive integers like 8 or 1,8")
            mbs.append(int(part))
    return {
        "strategies": _split(strategy, "--strategy") if strategy is not None else None,
        "micro_batches": mbs,
        "checkpointing": _split(checkpointing, "--checkpointing") if checkpointing is not None else None,
    }


def _split(text: str, flag: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise InputError(f"{flag} {text!r}: expected a comma-separated list without empty items")
    return parts


# --- registration: `tune MODEL` takes `llmctl plan`'s options, declared once there -------------------------------------
def _with_plan_options(command: Callable[..., None]) -> Callable[..., None]:
    from llmctl.cli.plan import plan_command

    theirs = inspect.signature(plan_command, eval_str=True).parameters
    sig = inspect.signature(command, eval_str=True)
    mine = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    from llmctl.launch.slurm_options import cli_parameters

    extra = [theirs[n].replace(kind=inspect.Parameter.KEYWORD_ONLY) for n in MODEL_OPTIONS]
    command.__signature__ = sig.replace(parameters=[*mine, *extra, *cli_parameters()])  # type: ignore[attr-defined]
    return command


def _plan_defaults() -> dict[str, Any]:
    from llmctl.cli.plan import plan_command

    params = inspect.signature(plan_command).parameters
    return {n: params[n].default for n in MODEL_OPTIONS}


_PLAN_DEFAULTS = _plan_defaults()


def register(app: typer.Typer) -> None:
    app.command("tune")(_with_plan_options(tune_command))
