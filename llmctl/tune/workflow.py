"""The `llmctl tune` workflow: the starting point (a plan file, or the plan `llmctl plan` would write for a model),
the pool of setups and the picks, the trial plans, the trials (locally one after another, or in one SLURM
allocation, llmctl.tune.job), the report, and the measured-best plan and calibration file written. Torch-free:
torch runs only inside the trials' ranks. The command line (llmctl.cli.tune) parses and renders.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import InputError, RuntimeFailure
from llmctl.fileio import write_atomic
from llmctl.plan import planner as pl
from llmctl.plan.request import Efficiency, PlanRequest
from llmctl.spec import planfile as pf
from llmctl.spec.decisions import on_command
from llmctl.spec.setup import TrainSetup
from llmctl.tune import job as tune_job
from llmctl.tune import run as tune_trials
from llmctl.tune import space as tune_space
from llmctl.tune import trials as tune_plans
from llmctl.tune.report import Report, Trial

DEFAULT_DIR = "llmctl-tune"
PLAN_OPTIONS = (
    "params",
    "gpu",
    "gpus",
    "nodes",
    "gpus_per_node",
    "cluster",
    "net",
    "intra_gbps",
    "inter_gbps",
    "global_batch",
    "global_batch_tokens",
    "tokens",
    "price",
    "objective",
    "overlap",
    "calibrate",
    "memory_margin",
    "data",
    "tokenizer",
    "synthetic",
    "run_dir",
    "checkpoint_every",
)
"""The `llmctl plan` options that are not decisions `tune MODEL` takes (by name, as build_request reads them)."""
OWN_DECISIONS = ("strategy", "micro_batch_size", "checkpointing", "compile")
"""The decisions tune varies itself (its --strategy, --micro-batch, --checkpointing lists and --compile pin)."""
DECISION_OPTIONS = {d.param: d.name for d in on_command(TrainSetup, "plan") if d.name not in OWN_DECISIONS}
"""The decisions' flags of `llmctl plan` that `tune MODEL` takes too (parameter name -> decision name)."""
PLAN_FILE_OPTIONS = ("gpu", "calibrate", "net", "inter_gbps", "intra_gbps")
"""The ones that also apply to `tune PLAN.yaml`: the GPU kind to predict for, a calibration of the model, and the
network (by default the one the plan records it was priced with)."""


@dataclass(frozen=True)
class TuneRequest:
    """What to tune and how: the command line's values, checked."""

    target: str
    """A plan file (.yaml/.yml) or a model as `llmctl plan` takes it."""
    plan_options: dict[str, Any]
    """`llmctl plan`'s options by name (PLAN_OPTIONS; those a plan file says are refused when given)."""
    given: tuple[str, ...]
    """The plan options given on the command line (flags), for the refusal with a plan file."""
    pins: dict[str, list[Any] | None]
    """strategies, micro_batches, checkpointing: the values to try (None: every value)."""
    compile: bool | None
    top: int
    steps: int
    warmup: int
    rounds: int
    output: Path
    calibration_out: Path
    force: bool
    tune_dir: str | None
    timeout_s: float
    slurm: dict[str, Any] | None
    """The SLURM options with --slurm (llmctl.launch.slurm_options), else None (local trials)."""


@dataclass
class Outcome:
    report: Report
    data: dict[str, Any]
    """The report as written (tune.json, the calibration file, --json)."""
    pool_size: int
    folder: Path
    written: tuple[Path, Path, Path] | None
    """(plan, calibration file, trial folder) once written; None when every trial failed."""


def is_plan_file(target: str) -> bool:
    return target.lower().endswith((".yaml", ".yml"))


def tune(r: TuneRequest, progress: Callable[[int, int, int], Any], say: Callable[[str], None]) -> Outcome:
    """Run the workflow; `progress(trials, steps, rounds)` makes the display the trials report to (a context
    manager with start/step/end), `say` prints a line. Raises RuntimeFailure (after the report is written to the
    trial folder) when every trial failed."""
    fail = tune_plans.failing_trials()
    if is_plan_file(r.target):
        refused = [f"--{n.replace('_', '-')}" for n in r.given if n not in PLAN_FILE_OPTIONS]
        if refused:
            raise InputError(f"{', '.join(refused)}: plan options apply to `tune MODEL`; a plan file already says them")
        base, pool, source = _from_plan_file(r.target, r.plan_options, r.pins, r.compile)
    else:
        base, pool, source = _from_model(r.target, r.plan_options, r.pins, r.compile)
    nodes = base.hardware.nodes
    if r.slurm is None:
        _check_local(nodes)
    _check_outputs(r.output, r.calibration_out, r.force)
    if not pool.ranked:
        raise InputError(f"no setup to try fits: {pool.dropped[0] if pool.dropped else 'empty space'}")

    picks = tune_space.select(pool.ranked, r.top)
    sbatch = _sbatch_params(base, r.slurm) if r.slurm is not None else None  # validated before anything is written
    folder = _new_folder(r.tune_dir, base.name)
    req = pool.request
    report = Report(
        source=source,
        model=req.spec.name,
        device=pool.device,
        nodes=base.hardware.nodes,
        nproc_per_node=base.hardware.nproc_per_node,
        seq_len=req.seq_len,
        global_batch_seqs=req.global_batch,
        attention=req.pin("attention") or "sdpa",
        loss_chunk_tokens=req.pin("loss_chunk_tokens") or 0,
        steps=r.steps,
        warmup=r.warmup,
        efficiency_calibration=req.efficiency.calibration,
        trials=[Trial(i + 1, c, folder / f"trial-{i + 1}") for i, c in enumerate(picks)],
        considered=len(pool.ranked),
        dropped=pool.dropped,
        rounds=r.rounds,
    )
    paths = {}
    shown = pool.device is not None
    for t in report.trials:
        plan = tune_plans.trial_plan(
            base, t.candidate, t.number, t.folder, r.steps, r.warmup, shown, t.number in fail, req.network
        )
        paths[t.number] = t.folder / "plan.yaml"
        pf.save_plan(plan, paths[t.number])
    say(report.header(len(pool.ranked), folder))
    if sbatch is not None:
        _run_in_allocation(report, paths, sbatch, folder, r.timeout_s, progress, say)
    else:
        with progress(len(report.trials), r.warmup + r.steps, r.rounds) as shown_progress:
            for rnd in range(1, r.rounds + 1):
                for t in report.trials:
                    if t.status == "failed":
                        continue  # an out-of-memory or a crash is not retried
                    shown_progress.start(t, rnd)
                    nproc = base.hardware.nproc_per_node
                    this_round = tune_trials.run_trial(
                        t, paths[t.number], nproc, r.warmup, r.warmup + r.steps, r.timeout_s, shown_progress.step
                    )
                    shown_progress.end(t, rnd, this_round)

    data = report.as_dict()
    write_atomic(folder / "tune.json", json.dumps(data, indent=2) + "\n")  # kept with the trials, whatever follows
    outcome = Outcome(report, data, len(pool.ranked), folder, None)
    best = report.best
    if best is None:
        return outcome
    plan = tune_plans.apply_setup(base, best.candidate, shown, "the measured-best plan", req.network)
    _check_outputs(r.output, r.calibration_out, r.force)  # again: a file that appeared while the trials ran
    pf.save_plan(plan, r.output)
    write_atomic(r.calibration_out, json.dumps(data, indent=2) + "\n")
    outcome.written = (r.output, r.calibration_out, folder)
    return outcome


def all_failed(outcome: Outcome) -> RuntimeFailure:
    first = outcome.report.trials[0]
    return RuntimeFailure(
        f"all {len(outcome.report.trials)} trials failed (trial {first.number}, {first.setup.label}: {first.reason})",
        hint=f"see {outcome.folder}/trial-*/output.log",
    )


# --- the two starting points -------------------------------------------------------------------------------------------
def _from_plan_file(
    path: str, options: dict[str, Any], pins: dict[str, Any], compile_: bool | None
) -> tuple[pf.Plan, tune_space.Pool, str]:
    from llmctl.engine.model import base_spec  # torch-free: the plan's model as the engine builds it, unpadded
    from llmctl.spec.hardware import resolve_gpu

    plan = pf.load_plan(path)
    gpu_name = options.get("gpu") or plan.hardware.gpu
    gpu = resolve_gpu(gpu_name) if gpu_name else None
    spec = base_spec(plan.model)
    network = None
    if options.get("net") or options.get("inter_gbps") or options.get("intra_gbps"):
        from llmctl.plan.network import network_for
        from llmctl.spec.hardware import make_cluster

        for flag, x in (("--inter-gbps", options.get("inter_gbps")), ("--intra-gbps", options.get("intra_gbps"))):
            if x is not None and not x > 0:
                raise InputError(f"{flag} must be positive, got {x}")
        hw = plan.hardware
        cluster = make_cluster(
            "the flags",
            gpu=(gpu.name if gpu else tune_space.REFERENCE_GPU),
            nodes=hw.nodes,
            gpus_per_node=hw.nproc_per_node,
            inter_node_gbps=options.get("inter_gbps"),
            intra_node_gbps=options.get("intra_gbps"),
        )
        network = network_for(cluster, options.get("net"))
    req = tune_space.request_for_plan(plan, spec, gpu, _efficiency(options.get("calibrate")), network)
    pipes = tune_space.schedule_variants(plan.setup, spec)  # a pipelined plan: its schedules tried beside it
    space = tune_space.space_for(plan.setup, spec, compile_=compile_, pipelines=pipes, **pins)
    return plan, tune_space.make_pool(req, space, gpu.name if gpu else None), path


def _from_model(
    model: str, options: dict[str, Any], pins: dict[str, Any], compile_: bool | None
) -> tuple[pf.Plan, tune_space.Pool, str]:
    from llmctl.plan.emit import DEFAULT_CHECKPOINT_MINUTES, run_plan

    if options.get("tokenizer") and not options.get("data"):
        raise InputError("--tokenizer only applies with --data (text files are tokenized with it)")
    if options.get("data") and options.get("synthetic"):
        raise InputError("give either --data PATH or --synthetic, not both")
    req = _model_request(model, options, pins, compile_)
    result = pl.plan(req)
    # The plan it writes is a run as `llmctl plan` writes it: its data (the trials train on it too), its run folder.
    base, _ = run_plan(
        result,
        options.get("data"),
        bool(options.get("synthetic")),
        options.get("tokenizer"),
        options.get("run_dir"),
        options.get("checkpoint_every") or DEFAULT_CHECKPOINT_MINUTES,
    )
    if base is None:
        raise InputError("--params gives no architecture for the engine to run", hint="pass a preset or a config.json")
    chosen = result.chosen.setup
    # The pool around the planner's choice: its kernel and loss kept, the four decisions free unless pinned.
    unpinned = dict.fromkeys(OWN_DECISIONS)
    req = req.with_pins(**unpinned, attention=chosen.attention, loss_chunk_tokens=chosen.loss_chunk_tokens)
    # Where the planner ranked pipelined setups, their pp and schedules are tried too (the best few).
    pipes = tune_space.plan_pipelines(result.variants)
    space = tune_space.space_for(chosen, req.spec, compile_=compile_, pipelines=pipes, **pins)
    pool = tune_space.make_pool(req, space, req.gpu.name, first=chosen)
    return base, pool, f"{model} (planned for {req.nodes} x {req.gpus_per_node} {req.gpu.name})"


def _model_request(model: str, o: dict[str, Any], pins: dict[str, Any], compile_: bool | None) -> PlanRequest:
    """`llmctl plan`'s request from the same options (`build_request`, its checks); a pin given as one value is the
    planner's pin, a list only restricts the trials."""
    from llmctl.plan.request import build_request

    def one(values: list[Any] | None) -> Any:
        return values[0] if values and len(values) == 1 else None

    options = {n: o[n] for n in PLAN_OPTIONS}
    decisions = {name: o[param] for param, name in DECISION_OPTIONS.items() if param in o}
    decisions.update(
        zip(OWN_DECISIONS, (*(one(pins[k]) for k in ("strategies", "micro_batches", "checkpointing")), compile_))
    )
    return build_request(model, options, decisions)[0]


def _efficiency(calibrate: str | None) -> Efficiency:
    if not calibrate:
        return Efficiency()
    from llmctl.plan.calibrate import read_calibration

    return Efficiency(calibration=read_calibration(calibrate).factor)


def _check_local(nodes: int) -> None:
    if nodes != 1:
        raise InputError(
            f"tune runs its trials on this machine, and this is a {nodes}-node setup",
            hint=f"pass --slurm to run them in one SLURM allocation of {nodes} nodes",
        )


# --- --slurm: the trials in one allocation ----------------------------------------------------------------------------
def _sbatch_params(base: pf.Plan, values: dict[str, Any]) -> Any:
    """The tune job's script parameters (validated; the folder is filled in once it exists)."""
    import shutil

    from llmctl.launch import slurm

    python, torchrun = slurm.node_python_and_torchrun()
    params = slurm.make_tune_params(
        job_name=f"tune-{base.name}",
        nodes=base.hardware.nodes,
        workdir=str(Path.cwd()),
        tune_dir="<new trial folder>",
        torchrun=torchrun,
        python=python,
        gpus_per_node=base.hardware.nproc_per_node if base.hardware.gpu else None,
        **values,
    )
    if shutil.which("sbatch") is None:
        raise RuntimeFailure("--slurm: sbatch not found", hint="run llmctl tune --slurm on a SLURM login node")
    return params


def _run_in_allocation(
    report: Report,
    paths: dict[int, Path],
    params: Any,
    folder: Path,
    timeout: float,
    progress: Callable[[int, int, int], Any],
    say: Callable[[str], None],
) -> None:
    """Submit one job that runs every trial (llmctl.tune.job), follow it to its end, fill in the trials."""

    from llmctl.launch import jobs, slurm

    spec = tune_job.JobSpec(
        nodes=report.nodes,
        nproc_per_node=report.nproc_per_node,
        warmup=report.warmup,
        steps=report.steps,
        rounds=report.rounds,
        timeout_s=timeout,
        trials=tuple(
            tune_job.TrialSpec(t.number, t.setup.label, str(paths[t.number]), str(t.folder)) for t in report.trials
        ),
    )
    spec.save(folder)
    script = folder / tune_job.SCRIPT
    write_atomic(script, slurm.render_tune(dataclasses.replace(params, tune_dir=str(folder))), mode=0o755)
    job_id = slurm.submit(script, folder)
    say(
        f"submitted tune job {job_id} ({report.nodes} node(s) x {report.nproc_per_node} processes): the trials run "
        f"one after another in it; its log: {folder / f'slurm-{job_id}.out'}"
    )
    steps = report.warmup + report.steps
    try:
        with progress(len(report.trials), steps, report.rounds) as shown:
            tune_job.follow(job_id, folder, report.trials, report.rounds, report.warmup, shown)
    except KeyboardInterrupt:
        jobs.scancel(job_id)
        say(f"cancelled tune job {job_id}")
        raise


def _check_outputs(out: Path, cal_out: Path, force: bool) -> None:
    if out.resolve() == cal_out.resolve():
        raise InputError(f"the plan and the calibration file would both be {out}", hint="give --calibration FILE")
    for p, what in ((out, "plan"), (cal_out, "calibration file")):
        if p.is_dir():
            raise InputError(f"{p} is a folder; expected a path for the {what}")
        if p.exists() and not force:
            raise InputError(
                f"{p} already exists; nothing was run",
                hint="pass --force to replace it, or -o/--calibration another path",
            )


def _new_folder(tune_dir: str | None, name: str) -> Path:
    from llmctl.launch import jobs

    root = Path(tune_dir or os.environ.get("LLMCTL_TUNE_DIR") or DEFAULT_DIR).absolute()
    try:
        return jobs.new_folder(root, f"tune-{name}")
    except OSError as e:
        raise InputError(f"--dir {root}: cannot create a trial folder there ({e.strerror or e})") from None
