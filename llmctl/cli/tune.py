"""`llmctl tune`: run the planner's best few setups for a few steps each on this machine and keep the one that is
measured fastest; write it as a plan, and the figures as a calibration file that `llmctl plan --calibrate` reads.

The setups, predictions, picks, trial plans and the report are torch-free logic in `llmctl.plan.tune`; the trials
run in `llmctl.cli.tune_trials` (the command `llmctl launch` runs locally, with a progress display), or with
`--slurm` in one SLURM allocation (`llmctl.cli.tune_job`: one sbatch job runs them one after another, this command
follows it); this module parses, picks the starting point (a plan file, or the plan `llmctl plan` would write for a
model), and renders.
Torch-free: torch runs only inside the trials' ranks.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from llmctl.cli import render, tune_trials
from llmctl.cli.options import JsonOpt
from llmctl.errors import InputError, RuntimeFailure
from llmctl.plan import planner as pl
from llmctl.plan import tune
from llmctl.spec import planfile as pf

DEFAULT_DIR = "llmctl-tune"

# The plan options `tune MODEL` takes, declared once in `llmctl plan` (its signature is copied below).
MODEL_OPTIONS = (
    "params",
    "gpu",
    "nodes",
    "gpus_per_node",
    "cluster",
    "net",
    "intra_gbps",
    "inter_gbps",
    "seq_len",
    "global_batch",
    "global_batch_tokens",
    "tokens",
    "price",
    "objective",
    "precision",
    "loss_chunk",
    "attention",
    "overlap",
    "calibrate",
)
PLAN_FILE_OPTIONS = ("gpu", "calibrate", "net", "inter_gbps", "intra_gbps")
"""The ones that also apply to `tune PLAN.yaml`: the GPU kind to predict for, a calibration of the model, and the
network (by default the one the plan records it was priced with)."""


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
    ] = tune.DEFAULT_TOP,
    steps: Annotated[int, typer.Option("--steps", help="Measured steps per trial.")] = tune.DEFAULT_STEPS,
    warmup: Annotated[
        int, typer.Option("--warmup", help="Steps each trial runs before measuring (compile, allocator, caches).")
    ] = tune.DEFAULT_WARMUP,
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
    out = Path(output)
    cal_out = Path(calibration_out) if calibration_out else out.with_name(out.stem + ".tune.json")
    pins = _pins(strategy, micro_batch, checkpointing)
    fail = tune.failing_trials()

    if _is_plan_file(target):
        given = [
            f"--{n.replace('_', '-')}" for n in MODEL_OPTIONS if n not in PLAN_FILE_OPTIONS and _given(n, plan_options)
        ]
        if given:
            raise InputError(f"{', '.join(given)}: plan options apply to `tune MODEL`; a plan file already says them")
        base, pool, source = _from_plan_file(target, plan_options, pins, compile_)
    else:
        base, pool, source = _from_model(target, plan_options, pins, compile_)
    nodes = base.hardware.nodes
    if not slurm:
        _check_local(nodes)
    _check_outputs(out, cal_out, force)
    if not pool.ranked:
        raise InputError(f"no setup to try fits: {pool.dropped[0] if pool.dropped else 'empty space'}")

    picks = tune.select(pool.ranked, top)
    sbatch = _sbatch_params(base, slurm_values) if slurm else None  # validated before anything is written
    folder = _new_folder(tune_dir, base.name)
    req = pool.request
    report = tune.Report(
        source=source,
        model=req.spec.name,
        device=pool.device,
        nodes=base.hardware.nodes,
        nproc_per_node=base.hardware.nproc_per_node,
        seq_len=req.seq_len,
        global_batch_seqs=req.global_batch,
        attention=req.attention or "sdpa",
        loss_chunk_tokens=req.loss_chunk_tokens or 0,
        steps=steps,
        warmup=warmup,
        efficiency_calibration=req.efficiency.calibration,
        trials=[tune.Trial(i + 1, c, folder / f"trial-{i + 1}") for i, c in enumerate(picks)],
        considered=len(pool.ranked),
        dropped=pool.dropped,
        rounds=rounds,
    )
    paths = {}
    for t in report.trials:
        shown = pool.device is not None
        plan = tune.trial_plan(
            base, t.candidate, t.number, t.folder, steps, warmup, shown, t.number in fail, pool.request.network
        )
        paths[t.number] = t.folder / "plan.yaml"
        pf.save_plan(plan, paths[t.number])
    tune_trials.say(_header(report, len(pool.ranked), folder))
    if sbatch is not None:
        _run_in_allocation(report, paths, sbatch, folder, timeout)
    else:
        with tune_trials.Progress(len(report.trials), warmup + steps, rounds) as progress:
            for rnd in range(1, rounds + 1):
                for t in report.trials:
                    if t.status == "failed":
                        continue  # an out-of-memory or a crash is not retried
                    progress.start(t, rnd)
                    nproc = base.hardware.nproc_per_node
                    this_round = tune_trials.run_trial(
                        t, paths[t.number], nproc, warmup, warmup + steps, timeout, progress.step
                    )
                    progress.end(t, rnd, this_round)

    data = report.as_dict()
    from llmctl.fileio import write_atomic

    write_atomic(folder / "tune.json", json.dumps(data, indent=2) + "\n")  # kept with the trials, whatever follows
    best = report.best
    if best is None:
        _show(report, data, json_out, written=None)
        first = report.trials[0]
        raise RuntimeFailure(
            f"all {len(report.trials)} trials failed (trial {first.number}, {first.setup.label}: {first.reason})",
            hint=f"see {folder}/trial-*/output.log",
        )
    predicted = best.candidate.predicted if pool.device is not None else None
    plan = tune.apply_setup(base, best.setup, predicted, "the measured-best plan", pool.request.network)
    _check_outputs(out, cal_out, force)  # again: a file that appeared while the trials ran is not overwritten
    pf.save_plan(plan, out)
    write_atomic(cal_out, json.dumps(data, indent=2) + "\n")
    _show(report, data, json_out, written=(out, cal_out, folder))


# --- the two starting points -------------------------------------------------------------------------------------------
def _is_plan_file(target: str) -> bool:
    return target.lower().endswith((".yaml", ".yml"))


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


def _from_plan_file(
    path: str, options: dict[str, Any], pins: dict[str, Any], compile_: bool | None
) -> tuple[pf.Plan, tune.Pool, str]:
    from llmctl.engine.model import base_spec  # torch-free: the plan's model as the engine builds it, unpadded
    from llmctl.spec.hardware import resolve_gpu

    plan = pf.load_plan(path)
    gpu_name = options.get("gpu") or plan.hardware.gpu
    gpu = resolve_gpu(gpu_name) if gpu_name else None
    spec = base_spec(plan)
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
            gpu=(gpu.name if gpu else tune.REFERENCE_GPU),
            nodes=hw.nodes,
            gpus_per_node=hw.nproc_per_node,
            inter_node_gbps=options.get("inter_gbps"),
            intra_node_gbps=options.get("intra_gbps"),
        )
        network = network_for(cluster, options.get("net"))
    req = tune.request_for_plan(plan, spec, gpu, _efficiency(options.get("calibrate")), network)
    base = tune.Setup.of_plan(plan)
    space = tune.space_for(base, spec, plan.hardware.nodes, plan.world_size, compile_=compile_, **pins)
    return plan, tune.make_pool(req, space, gpu.name if gpu else None), path


def _from_model(
    model: str, options: dict[str, Any], pins: dict[str, Any], compile_: bool | None
) -> tuple[pf.Plan, tune.Pool, str]:
    from llmctl.cli.plan import _train_from_local_weights

    req = _model_request(model, options, pins, compile_)
    result = pl.plan(req)
    base = _train_from_local_weights(pl.to_plan(result))
    if base is None:
        raise InputError("--params gives no architecture for the engine to run", hint="pass a preset or a config.json")
    c = result.chosen
    # The pool around the planner's choice: its kernel and loss kept, the four decisions free unless pinned.
    req = dataclasses.replace(
        req,
        strategy=None,
        micro_batch=None,
        checkpointing=None,
        compile=None,
        attention=c.attention,
        loss_chunk_tokens=c.loss_chunk_tokens,
    )
    chosen = tune.Setup(c.strategy, c.micro_batch, c.grad_accum, c.checkpointing, c.compile)
    space = tune.space_for(chosen, req.spec, req.nodes, c.gpus, compile_=compile_, **pins)
    pool = tune.make_pool(req, space, req.gpu.name, first=chosen)
    return base, pool, f"{model} (planned for {req.nodes} x {req.gpus_per_node} {req.gpu.name})"


def _model_request(model: str, o: dict[str, Any], pins: dict[str, Any], compile_: bool | None) -> pl.PlanRequest:
    """`llmctl plan`'s request from the same options (`build_request`, its checks); a pin given as one value is the
    planner's pin, a list only restricts the trials."""
    from llmctl.cli.plan import build_request

    def one(values: list[Any] | None) -> Any:
        return values[0] if values and len(values) == 1 else None

    options = {n: o[n] for n in MODEL_OPTIONS}
    strategy, micro_batch, checkpointing = (one(pins[k]) for k in ("strategies", "micro_batches", "checkpointing"))
    return build_request(model, options, strategy, micro_batch, checkpointing, compile_)[0]


def _efficiency(calibrate: str | None) -> pl.Efficiency:
    if not calibrate:
        return pl.Efficiency()
    from llmctl.cli.plan import read_calibration

    return pl.Efficiency(calibration=read_calibration(calibrate).factor)


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


def _run_in_allocation(report: tune.Report, paths: dict[int, Path], params: Any, folder: Path, timeout: float) -> None:
    """Submit one job that runs every trial (llmctl.cli.tune_job), follow it to its end, fill in the trials."""
    import dataclasses

    from llmctl.cli import tune_job
    from llmctl.fileio import write_atomic
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
    tune_trials.say(
        f"submitted tune job {job_id} ({report.nodes} node(s) x {report.nproc_per_node} processes): the trials run "
        f"one after another in it; its log: {folder / f'slurm-{job_id}.out'}"
    )
    steps = report.warmup + report.steps
    try:
        with tune_trials.Progress(len(report.trials), steps, report.rounds) as progress:
            tune_job.follow(job_id, folder, report.trials, report.rounds, report.warmup, progress)
    except KeyboardInterrupt:
        jobs.scancel(job_id)
        tune_trials.say(f"cancelled tune job {job_id}")
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


# --- display -----------------------------------------------------------------------------------------------------------
def _header(report: tune.Report, pool_size: int, folder: Path) -> str:
    r = report
    pred = (
        f"predictions for {r.device}"
        if r.device
        else f"no predictions (the plan names no GPU kind; order from the planner's model on {tune.REFERENCE_GPU})"
    )
    dropped = f", {len(r.dropped)} do not fit" if r.dropped else ""
    return (
        f"tune {r.source}: {len(r.trials)} of {pool_size} setups{dropped}; global batch {r.global_batch_seqs} x "
        f"{r.seq_len} tokens on {r.nodes} x {r.nproc_per_node} ranks; {r.warmup} warm-up + {r.steps} measured steps "
        f"each{f', {r.rounds} rounds' if r.rounds > 1 else ''}; {pred}\ntrials in {folder}"
    )


def _show(report: tune.Report, data: dict[str, Any], json_out: bool, written: tuple[Path, Path, Path] | None) -> None:
    if json_out:
        if written:
            data = {
                **data,
                "plan_path": str(written[0]),
                "calibration_path": str(written[1]),
                "tune_dir": str(written[2]),
            }
        render.print_json(data)
        return
    c = render.console
    shown = report.device is not None
    # Step time is not a column: at the fixed global batch it is tokens per step / tokens/s (it is in the JSON).
    t = render.table(
        f"Trials: predicted{f' for {report.device}' if shown else ' (order only)'} vs measured here",
        [
            ("#", "right"),
            ("setup", "left"),
            ("tok/s\npred", "right"),
            ("tok/s\nmeas", "right"),
            ("ratio", "right"),
            ("GiB\npred", "right"),
            ("GiB\nmeas", "right"),
            ("rank\npred", "right"),
            ("rank\nmeas", "right"),
            ("status", "left"),
        ],
    )
    for i, col in enumerate(t.columns):
        col.no_wrap = i != 1  # figures stay whole; a narrow terminal wraps the setup's name
    t.columns[1].min_width = 14
    best = report.best
    for row in data["trials"]:
        p, m = row["predicted"], row["measured"]
        t.add_row(
            str(row["trial"]),
            row["label"],
            f"{p['tokens_per_s']:,.0f}" if p else "-",
            f"{m['tokens_per_s']:,.0f}" if m else "-",
            f"{row['ratio']:.3g}" if row["ratio"] is not None else "-",
            render.gib(p["memory_per_gpu_bytes"], 2) if p else "-",
            render.gib(m["peak_memory_bytes"], 2) if m and m["peak_memory_bytes"] is not None else "-",
            str(row["rank_predicted"]),
            str(row["rank_measured"] or "-"),
            row["status"],
            style="bold green" if best is not None and row["trial"] == best.number else None,
        )
    c.print(t)
    kinds = {row["measured"]["memory_kind"] for row in data["trials"] if row["measured"]}
    if "peak_rss_bytes" in kinds:
        c.print("[dim]GiB meas on a CPU: rank 0's peak resident memory (getrusage), not a device's[/dim]")
    for row in data["trials"]:
        if row["status"] != "ok":
            c.print(f"trial {row['trial']} failed: {escape(row['reason'] or '?')}", soft_wrap=True)
    verdict = data["ranking_verdict"]
    if verdict:
        c.print(f"[bold]{escape(verdict)}[/bold]", soft_wrap=True)
    elif len(report.ok) > 1:
        c.print("the planner's ranking held: the measured order is the predicted order")
    if best is None or written is None:
        return
    m = best.measured
    assert m is not None  # best is a trial that ran
    pred = best.candidate.predicted
    vs = f" (predicted {pred.tokens_per_s:,.0f}, ratio {m.tokens_per_s / pred.tokens_per_s:.3g})" if shown else ""
    plan_path, cal_path, folder = (escape(str(p)) for p in written)
    for line in (
        f"\n[bold]measured best[/bold]: trial {best.number}, {escape(best.setup.label)}: {m.tokens_per_s:,.0f} "
        f"tokens/s{vs}, {m.step_time_s:.3f} s/step",
        f"plan written to {plan_path} (run it: llmctl launch {plan_path})",
        f"calibration written to {cal_path} (llmctl plan ... --calibrate {cal_path})",
        f"trials in {folder}",
    ):
        c.print(line, soft_wrap=True)


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
