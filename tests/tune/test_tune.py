"""`llmctl tune`: which setups it picks, what a trial's metrics become, the report and calibration file, the one-line
refusals, and (marked dist/slow) a real tune of the tiny 2-layer Llama on 2 gloo ranks: three setups that differ
in speed run, one crashes on purpose ($LLMCTL_TUNE_FAIL_TRIALS) and the others go on, the measured best is written
and `llmctl plan --calibrate` reads the calibration file."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llmctl.cli import tune as cli_tune
from llmctl.cli.main import app
from llmctl.errors import InputError
from llmctl.plan.calibrate import from_tune_report
from llmctl.plan.timing import Candidate
from llmctl.spec.planfile import load_plan, plan_from_dict
from llmctl.tune import report as tune_report
from llmctl.tune import run as tune_trials
from llmctl.tune import space as tune_space
from llmctl.tune import trials as tune_plans
from llmctl.tune import workflow
from tests.engine.conftest import TINY, deep_update

runner = CliRunner()
A100 = "A100-80GB"
# The tiny plan at micro-batch 8 x 1 on 2 ranks (global batch 16 sequences of 64 tokens), predicted for an A100.
BASE = deep_update(TINY, {"hardware": {"gpu": A100}, "training": {"micro_batch_size": 8, "grad_accum_steps": 1}})
# Setups that differ in speed on this CPU (8x1 measured 4-6x faster than 1x8; full recompute ~1.3x slower).
SPACE = ["--micro-batch", "1,8", "--checkpointing", "none,full", "--no-compile", "--strategy", "full_shard"]


def write(folder: Path, over: dict | None = None) -> Path:
    plan = deep_update(BASE, over or {})
    plan["logging"] = {**plan.get("logging", {}), "dir": str(folder / "run-logs")}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "base.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def pool_for(over: dict | None = None, **space: object) -> tune_space.Pool:
    from llmctl.engine.model import base_spec
    from llmctl.spec.hardware import resolve_gpu

    data = deep_update(BASE, over or {})
    if over and "model" in over:
        data["model"] = over["model"]  # a different model: not merged with the tiny one's overrides
    plan = plan_from_dict(data)
    gpu = resolve_gpu(plan.hardware.gpu) if plan.hardware.gpu else None
    spec = base_spec(plan.model)
    req = tune_space.request_for_plan(plan, spec, gpu)
    s = tune_space.space_for(plan.setup, spec, **space)  # type: ignore[arg-type]
    return tune_space.make_pool(req, s, gpu.name if gpu else None)


def labels(cands: list[Candidate]) -> list[str]:
    return [c.setup.label for c in cands]


# --- picks ---------------------------------------------------------------------------------------------------------
def test_picks_the_predicted_best_then_one_decision_at_a_time() -> None:
    pool = pool_for(strategies=["full_shard"], micro_batches=[1, 8], checkpointing=["none", "full"], compile_=False)
    assert len(pool.ranked) == 4 and pool.device == A100 and not pool.dropped
    picks = tune_space.select(pool.ranked, 4)
    # best; the best differing only in micro-batch; only in checkpointing; then the rest by prediction
    assert labels(picks) == [
        "full_shard 8x1 ckpt none",
        "full_shard 1x8 ckpt none",
        "full_shard 8x1 ckpt full",
        "full_shard 1x8 ckpt full",
    ]
    assert labels(tune_space.select(pool.ranked, 2)) == labels(picks)[:2]
    assert tune_space.select(pool.ranked, 10) == picks  # never more than the pool
    ranked_tps = [c.predicted.tokens_per_s for c in pool.ranked]
    assert ranked_tps == sorted(ranked_tps, reverse=True)


def test_default_space_alternatives_each_change_one_decision() -> None:
    pool = pool_for()
    picks = tune_space.select(pool.ranked, 5)
    best = picks[0].setup
    assert best == pool.ranked[0].setup
    for decision, pick in zip(tune_space.DECISIONS[:4], picks[1:], strict=True):  # no pipeline in this space
        assert tune_space.differs_only_in(pick.setup, best, decision), (decision, pick.setup)
    per_rank = {c.setup.micro_batch_size * c.setup.grad_accum_steps for c in pool.ranked}
    assert per_rank == {8}  # the global batch is held: micro-batch x accumulation = the plan's 8 per rank
    assert {c.setup.micro_batch_size for c in pool.ranked} == {1, 2, 4, 8}
    assert {c.setup.strategy for c in pool.ranked} == {"full_shard", "no_shard"}  # no hybrid on one node


def test_a_plan_without_gpu_is_ordered_but_shows_no_prediction() -> None:
    pool = pool_for({"hardware": {"gpu": None}}, micro_batches=[1, 8], compile_=False)
    assert pool.device is None and pool.request.gpu.name == tune_space.REFERENCE_GPU
    assert pool.ranked[0].setup.micro_batch_size == 8
    report = make_report(pool, [100.0, 50.0])
    data = report.as_dict()
    assert data["predicted_for"] is None and all(t["predicted"] is None and t["ratio"] is None for t in data["trials"])
    with pytest.raises(InputError, match="no prediction"):
        from_tune_report(data, "x.json")


def test_memory_that_does_not_fit_is_dropped() -> None:
    # Llama-2-7B at 8k tokens on 2 A100-80GB: ~56 GB of model states per GPU; no checkpointing adds ~45 GB of
    # activations at micro-batch 1, full checkpointing ~2 GB.
    over = {
        "model": {"preset": "llama-2-7b"},
        "training": {"seq_len": 8192, "precision": "bf16-mixed", "micro_batch_size": 1},
    }
    pool = pool_for(over, checkpointing=["none", "full"], compile_=False, strategies=["full_shard"])
    assert labels(pool.ranked) == ["full_shard 1x1 ckpt full"]
    assert len(pool.dropped) == 1 and "ckpt none" in pool.dropped[0] and "GiB per GPU predicted >" in pool.dropped[0]


def test_space_refusals() -> None:
    with pytest.raises(InputError, match="--micro-batch 3 does not divide the 8 sequences per rank"):
        pool_for(micro_batches=[3])
    with pytest.raises(InputError, match="hybrid_shard needs at least 2 nodes"):
        pool_for(strategies=["hybrid"])
    with pytest.raises(InputError, match="unknown checkpointing"):
        pool_for(checkpointing=["sometimes"])


def test_model_form_starts_from_the_planners_choice() -> None:
    opts = dict(cli_tune._PLAN_DEFAULTS)
    opts.update(gpu=A100, gpus_per_node=2, seq_len=64, global_batch=16, precision="fp32")
    pins = {"strategies": None, "micro_batches": None, "checkpointing": None}
    base, pool, _ = workflow._from_model("llama-tiny", opts, pins, False)
    r = runner.invoke(
        app,
        ["plan", "llama-tiny", "--gpu", A100, "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "16"]
        + ["--precision", "fp32", "--no-compile", "--no-write", "--json"],
    )
    chosen = json.loads(r.stdout)["chosen"]
    first = pool.ranked[0].setup
    assert (first.strategy, first.micro_batch_size, first.grad_accum_steps, first.checkpointing) == (
        chosen["strategy"],
        chosen["micro_batch"],
        chosen["grad_accum"],
        chosen["checkpointing"],
    )
    assert base.setup == first and base.hardware.gpu == A100

    # Without --data the measured-best plan is synthetic but still checkpoints into its run folder (as `plan` writes
    # it); with --data and --run-dir it is the run `llmctl plan` would write: tokens of that data, that folder.
    assert base.data.kind == "synthetic" and base.checkpoint.dir == f"runs/{base.name}/checkpoints"
    corpus = str(Path(__file__).resolve().parents[2] / "examples" / "corpus")
    opts.update(data=[corpus], run_dir="r")
    base, _, _ = workflow._from_model("llama-tiny", opts, pins, False)
    assert base.data.kind == "text" and base.data.paths == [corpus]
    assert base.checkpoint.dir == "r/checkpoints" and base.logging.dir == "r"
    with pytest.raises(InputError, match="--tokenizer only applies with --data"):
        workflow._from_model("llama-tiny", {**opts, "data": None, "tokenizer": "tok"}, pins, False)


# --- trial plans, measurements, the report -----------------------------------------------------------------------
def test_trial_plan_runs_steps_without_checkpoints_and_the_hook_breaks_its_data(tmp_path: Path) -> None:
    base = plan_from_dict(deep_update(BASE, {"checkpoint": {"dir": "ckpt"}, "logging": {"tensorboard": True}}))
    pool = pool_for()
    cand = pool.ranked[3]
    p = tune_plans.trial_plan(base, cand, 2, tmp_path / "trial-2", 5, 2, True, network=pool.request.network)
    assert p.training.max_steps == 7 and p.training.token_budget is None
    assert p.checkpoint.dir is None and p.logging.dir == str(tmp_path / "trial-2" / "logs")
    assert p.logging.interval_steps == 1 and not p.logging.tensorboard
    assert p.setup == cand.setup
    assert p.predicted.tokens_per_s == round(cand.predicted.tokens_per_s, 1)
    assert p.predicted.intra_node_busbw_gbytes_s == round(pool.request.network.intra_gbytes_s, 3) > 0
    assert p.predicted.inter_node_busbw_gbytes_s is None  # one node
    assert p.model == base.model and p.data == base.data
    broken = tune_plans.trial_plan(base, cand, 2, tmp_path / "t", 5, 2, with_prediction=False, fail=True)
    assert "missing-on-purpose" in broken.data.paths[0] and broken.predicted.tokens_per_s is None
    assert tune_plans.failing_trials({tune_plans.FAIL_ENV: "3, 1"}) == {1, 3}
    with pytest.raises(InputError):
        tune_plans.failing_trials({tune_plans.FAIL_ENV: "two"})


def test_measure_takes_medians_after_warmup() -> None:
    recs = [{"event": "start", "step": 0}]
    recs += [
        {"event": "step", "step": i, "tokens_per_s": tps, "step_time_s": 1024 / tps, "peak_rss_bytes": rss}
        for i, tps, rss in ((1, 10.0, 5), (2, 20.0, 6), (3, 1000.0, 7), (4, 1200.0, 9), (5, 1100.0, 8))
    ]
    m = tune_report.measure(recs, warmup=2)
    assert m is not None and m.steps == 3
    assert m.tokens_per_s == 1100.0 and m.step_time_s == pytest.approx(1024 / 1100)
    assert (m.peak_memory_bytes, m.memory_kind) == (9, "peak_rss_bytes")
    assert tune_report.measure(recs, warmup=5) is None


def test_rounds_take_the_geometric_mean_of_round_medians() -> None:
    def round_of(tps: float) -> list[dict]:
        return [{"event": "step", "step": i, "tokens_per_s": tps, "step_time_s": 1024 / tps} for i in (1, 2, 3)]

    # the machine twice as fast in round 2: every trial's figure is scaled alike, the ratio between them kept
    slow = tune_report.measure_rounds([round_of(1000.0), round_of(2000.0)], warmup=1)
    fast = tune_report.measure_rounds([round_of(1100.0), round_of(2200.0)], warmup=1)
    assert slow is not None and fast is not None and slow.steps == 4
    assert slow.tokens_per_s == pytest.approx((1000.0 * 2000.0) ** 0.5)
    assert fast.tokens_per_s / slow.tokens_per_s == pytest.approx(1.1)
    assert slow.step_time_s == pytest.approx(1024 / slow.tokens_per_s)
    assert tune_report.measure_rounds([round_of(1000.0), []], warmup=1) is None


def test_a_trial_with_allocator_retries_ranks_below_one_without() -> None:
    def steps(tps: float, retries: int | None) -> list[dict]:
        extra = {} if retries is None else {"alloc_retries": retries}
        return [{"event": "step", "step": i, "tokens_per_s": tps, "step_time_s": 1.0, **extra} for i in (1, 2, 3)]

    edgy = tune_report.measure_rounds([steps(3000.0, 0), steps(3000.0, 5)], warmup=0)
    assert edgy is not None and edgy.alloc_retries == 5 and edgy.as_dict()["alloc_retries"] == 5
    assert tune_report.measure(steps(1000.0, None), warmup=0).alloc_retries == 0  # a CPU run has no allocator
    pool = pool_for(strategies=["full_shard"], micro_batches=[1, 8], checkpointing=["none"], compile_=False)
    report = make_report(pool, [1000.0, 3000.0])
    report.trials[1].measured = edgy  # faster, but the allocator had to free its cache and retry
    assert report.best is not None and report.best.number == 1
    assert report.rank_measured() == {1: 1, 2: 2}
    report.trials[1].measured = tune_report.measure(steps(3000.0, 0), warmup=0)
    assert report.best.number == 2


def make_report(pool: tune_space.Pool, measured: list[float | None]) -> tune_report.Report:
    trials = []
    for i, (cand, tps) in enumerate(zip(pool.ranked, measured, strict=False)):
        t = tune_report.Trial(i + 1, cand, Path(f"/x/trial-{i + 1}"))
        if tps is None:
            t.status, t.reason = "failed", "exit 1: boom"
        else:
            t.status, t.measured = "ok", tune_report.Measured(tps, 1024 / tps, 1 << 30, "peak_rss_bytes", 4)
        trials.append(t)
    return tune_report.Report(
        "base.yaml", "llama-tiny", pool.device, 1, 2, 64, 16, "sdpa", 0, 4, 2, 1.0, trials, len(pool.ranked)
    )


def test_report_ranks_verdict_and_calibration() -> None:
    pool = pool_for(strategies=["full_shard"], micro_batches=[1, 8], checkpointing=["none", "full"], compile_=False)
    # predicted order 1, 2, 3, 4; measured: trial 2 fastest, trial 4 failed
    report = make_report(pool, [1000.0, 3000.0, 900.0, None])
    data = report.as_dict()
    assert data["best_trial"] == 2 and report.best is not None and report.best.number == 2
    assert [t["rank_predicted"] for t in data["trials"]] == [1, 2, 3, 4]
    assert [t["rank_measured"] for t in data["trials"]] == [2, 1, 3, None]
    assert data["ranking_agrees"] is False
    assert data["ranking_verdict"].startswith("the planner's ranking was wrong: it predicted trial 1")
    assert "trial 2" in data["ranking_verdict"] and "3.00x" in data["ranking_verdict"]
    assert data["trials"][3]["status"] == "failed" and data["trials"][3]["measured"] is None
    cal = from_tune_report(json.loads(json.dumps(data)), "tune.json")
    assert cal.factor == pytest.approx(3000.0 / pool.ranked[1].predicted.tokens_per_s)
    # agreeing orders: no verdict; a small margin is flagged as possible noise
    assert make_report(pool, [3000.0, 2000.0, 1000.0]).ranking_verdict() is None
    assert "may be noise" in (make_report(pool, [1000.0, 1050.0]).ranking_verdict() or "")
    below = make_report(pool, [3000.0, 1000.0, 2000.0]).ranking_verdict()
    assert below is not None and below.startswith("the planner's ranking was wrong below the top")


def test_a_verdict_the_rounds_disagree_on_is_flagged_as_noise() -> None:
    def round_of(tps: float) -> list[dict]:
        return [{"event": "step", "step": i, "tokens_per_s": tps, "step_time_s": 1024 / tps} for i in (1, 2, 3)]

    pool = pool_for(strategies=["full_shard"], micro_batches=[1, 8], checkpointing=["none"], compile_=False)
    report = make_report(pool, [1.0, 1.0])
    for t, rounds in zip(report.trials, ([1000.0, 900.0], [800.0, 1500.0]), strict=True):
        t.round_records = [round_of(x) for x in rounds]
        t.measured = tune_report.measure_rounds(t.round_records, report.warmup)
    verdict = report.ranking_verdict() or ""
    assert "trial 2" in verdict and "but not in every round (0.80x, 1.67x): it may be noise" in verdict
    report.trials[1].round_records = [round_of(x) for x in (1100.0, 1500.0)]
    report.trials[1].measured = tune_report.measure_rounds(report.trials[1].round_records, report.warmup)
    assert "noise" not in (report.ranking_verdict() or "x")


def test_plan_calibrate_reads_a_tune_report(tmp_path: Path) -> None:
    pool = pool_for(strategies=["full_shard"], micro_batches=[1, 8], checkpointing=["none"], compile_=False)
    data = make_report(pool, [2000.0, 500.0]).as_dict()
    data["efficiency_calibration"] = 0.5  # predictions made with a calibrated model: the factor stays absolute
    f = tmp_path / "t.tune.json"
    f.write_text(json.dumps(data, indent=2))
    r = runner.invoke(app, ["plan", "llama-tiny", "--gpu", A100, "--no-write", "--json", "--calibrate", str(f)])
    assert r.exit_code == 0, r.output
    cal = json.loads(r.stdout)["calibration"]
    assert cal["factor"] == pytest.approx(0.5 * 2000.0 / pool.ranked[0].predicted.tokens_per_s)
    assert "tune trial 1" in cal["method"]
    data["best_trial"] = None
    f.write_text(json.dumps(data))
    r = runner.invoke(app, ["plan", "llama-tiny", "--gpu", A100, "--no-write", "--calibrate", str(f)])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"llmctl: error: {f}: no trial ran to the end, nothing to calibrate with"
    ]


# --- the trial runner on stand-in commands -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "timeout", "reason"),
    [
        ("import time; time.sleep(60)", 1.0, "timed out after 1 s"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 30.0, "killed by SIGKILL"),
        (
            "raise SystemExit('llmctl: error: [rank 1] something broke')",
            30.0,
            "exit 1: llmctl: error: [rank 1] something",
        ),
        ("pass", 30.0, "no step records after the 1 warm-up steps"),
        (
            "import json, os; open(os.environ['LLMCTL_ERROR_FILE'], 'a').write(json.dumps({'message': 'out of "
            "memory: CUDA out of memory', 'exit_code': 1, 'kind': 'OutOfMemoryError', 'rank': 1}) + '\\n'); "
            "raise SystemExit(1)",
            30.0,
            "out of memory: rank 1: out of memory: CUDA out of memory",
        ),
    ],
    ids=["timeout", "signal", "stderr", "no-steps", "oom"],
)
def test_run_trial_failures_are_one_line(tmp_path: Path, monkeypatch, code: str, timeout: float, reason: str) -> None:
    monkeypatch.setattr("llmctl.launch.local.torchrun_argv", lambda plan, nproc: [sys.executable, "-c", code])
    monkeypatch.setattr(tune_trials, "STOP_GRACE_S", 2.0)
    pool = pool_for()
    t = tune_report.Trial(1, pool.ranked[0], tmp_path)
    tune_trials.run_trial(t, tmp_path / "plan.yaml", 2, warmup=1, total_steps=3, timeout_s=timeout)
    assert t.status == "failed" and t.measured is None
    assert t.reason is not None and t.reason.startswith(reason), t.reason
    assert "\n" not in t.reason


FAKE_ENGINE = """
import json, os, sys, time
plan = sys.argv[1]
logs = os.path.join(os.path.dirname(plan), "logs")
os.makedirs(logs, exist_ok=True)
with open(os.path.join(logs, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"event": "start", "step": 0}) + "\\n")
    for step in (1, 2, 3):
        f.write(json.dumps({"event": "step", "step": step, "tokens_per_s": 100.0 * step, "step_time_s": 10.24 / step,
                            "peak_rss_bytes": 1000 * step}) + "\\n")
"""


def test_rounds_pool_the_steps_of_every_round(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(
        "llmctl.launch.local.torchrun_argv", lambda plan, nproc: [sys.executable, "-c", FAKE_ENGINE, str(plan)]
    )
    t = tune_report.Trial(1, pool_for().ranked[0], tmp_path)
    steps: list[int] = []
    for _ in range(2):
        tune_trials.run_trial(t, tmp_path / "plan.yaml", 2, warmup=1, total_steps=3, timeout_s=30, on_step=steps.append)
        assert t.status == "ok" and t.reason is None
    assert t.rounds == 2 and [len(r) for r in t.round_records] == [4, 4] and steps[-1] == 3
    assert t.measured is not None and t.measured.steps == 4  # steps 2 and 3 of each round
    assert t.measured.tokens_per_s == pytest.approx(250.0) and t.measured.peak_memory_bytes == 3000
    assert (tmp_path / "output.log").read_text().count("llmctl tune: round") == 2


def test_every_trial_failing_is_exit_1_with_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "llmctl.launch.local.torchrun_argv", lambda plan, nproc: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    plan = write(tmp_path / "in")
    r = runner.invoke(app, ["tune", str(plan), "--top", "2", "--dir", "trials", *SPACE])
    assert r.exit_code == 1, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("llmctl: error: all 2 trials failed (trial 1, full_shard 8x1 ckpt none: exit 3")
    assert "Traceback" not in r.output
    assert not (tmp_path / "plan.yaml").exists() and not (tmp_path / "plan.tune.json").exists()
    assert len(list((tmp_path / "trials").glob("*/tune.json"))) == 1  # the record stays with the trials


# --- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tune", "missing.yaml"], "missing.yaml: no such plan file"),
        (["tune", "{plan}", "--top", "0"], "--top must be >= 1, got 0"),
        (["tune", "{plan}", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["tune", "{plan}", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["tune", "{plan}", "--timeout", "0"], "--timeout must be a positive number of seconds"),
        (["tune", "{plan}", "-o", "exists.yaml"], "exists.yaml already exists; nothing was run"),
        (["tune", "{plan}", "--calibration", "exists.yaml"], "exists.yaml already exists; nothing was run"),
        (["tune", "{plan}", "-o", "a.yaml", "--calibration", "a.yaml"], "would both be a.yaml"),
        (["tune", "{plan}", "--time", "10"], "--time: SLURM options apply with --slurm"),
        (["tune", "{plan}", "--slurm", "--time", "1:00", "--signal-lead", "300"], "--time 1:00: the job would get its"),
        (["tune"], "no plan file or model given"),
        (["tune", "{plan}", "--seq-len", "128"], "--seq-len: plan options apply to `tune MODEL`"),
        (["tune", "{plan}", "--micro-batch", "3"], "--micro-batch 3 does not divide the 8 sequences per rank"),
        (["tune", "{plan}", "--micro-batch", "1,,8"], "--micro-batch '1,,8': expected a comma-separated list"),
        (["tune", "{plan}", "--checkpointing", "often"], "unknown checkpointing 'often'"),
        (["tune", "{plan}", "--gpu", "Z9000"], "unknown GPU kind 'Z9000'"),
        (["tune", "llama-tiny", "--gpu", A100, "--nodes", "2", "--inter-gbps", "100"], "this is a 2-node setup"),
        (["tune", "llama-tiny"], "no GPU kind given"),
        (["tune", "--params", "7B", "--gpu", A100], "--params gives no architecture for the engine to run"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_runs_nothing(
    tmp_path: Path, monkeypatch, args: list[str], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    plan = write(tmp_path / "in")
    (tmp_path / "exists.yaml").write_text("keep me\n")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    r = runner.invoke(app, [a.replace("{plan}", str(plan)) for a in args])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and lines[0].startswith("llmctl: error: ") and message in lines[0], r.output
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # no trial folder, nothing overwritten
    assert (tmp_path / "exists.yaml").read_text() == "keep me\n"


def test_existing_default_output_is_refused_before_any_trial(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    plan = write(tmp_path / "in")
    (tmp_path / "plan.yaml").write_text("mine\n")
    r = runner.invoke(app, ["tune", str(plan)])
    assert r.exit_code == 2 and r.output.strip() == (
        "llmctl: error: plan.yaml already exists; nothing was run (pass --force to replace it, or -o/--calibration "
        "another path)"
    )
    assert not (tmp_path / "llmctl-tune").exists()


# --- the real thing ----------------------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_tune_tiny_llama_on_two_gloo_ranks(tmp_path: Path, monkeypatch) -> None:
    """Four trials of the tiny Llama (2 ranks, gloo): 8x1, 1x8, 8x1 with full checkpointing (made to crash by the
    hook) and 1x8 with full checkpointing; the crash is one line and the fourth still runs; the measured best is
    written and `plan --calibrate` reads the calibration file."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    for k, v in {
        "TMPDIR": str(scratch),  # torchrun leaves torchelastic_* folders here
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        "OMP_NUM_THREADS": "1",
        tune_plans.FAIL_ENV: "3",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LLMCTL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    plan = write(tmp_path / "in")
    args = ["tune", str(plan), "--top", "4", "--steps", "4", "--warmup", "2", *SPACE]
    r = runner.invoke(app, [*args, "-o", "best.yaml", "--dir", "trials", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    trials = data["trials"]
    assert [t["label"] for t in trials] == [
        "full_shard 8x1 ckpt none",
        "full_shard 1x8 ckpt none",
        "full_shard 8x1 ckpt full",
        "full_shard 1x8 ckpt full",
    ]
    assert [t["status"] for t in trials] == ["ok", "ok", "failed", "ok"]
    failed = trials[2]
    assert "missing-on-purpose" in failed["reason"] and "\n" not in failed["reason"]
    assert (Path(failed["folder"]) / "output.log").is_file()
    ok = [t for t in trials if t["status"] == "ok"]
    for t in ok:
        m = t["measured"]
        assert m["steps"] == 4 and m["tokens_per_s"] > 0 and m["peak_memory_bytes"] > 0
        assert t["ratio"] == pytest.approx(m["tokens_per_s"] / t["predicted"]["tokens_per_s"])
    speeds = {t["label"]: t["measured"]["tokens_per_s"] for t in ok}
    # Really different: ~5x here on an idle machine; the margin leaves room for other jobs' load between trials.
    assert speeds["full_shard 8x1 ckpt none"] > 1.25 * speeds["full_shard 1x8 ckpt none"]
    best = max(ok, key=lambda t: t["measured"]["tokens_per_s"])
    assert data["best_trial"] == best["trial"] and best["candidate"]["micro_batch"] == 8
    assert [t["rank_measured"] for t in trials if t["status"] == "ok"] == [
        sorted(speeds.values(), reverse=True).index(t["measured"]["tokens_per_s"]) + 1 for t in ok
    ]
    assert (data["ranking_verdict"] is None) == data["ranking_agrees"]

    # The written plan is the base plan with the measured best's setup and prediction.
    written = load_plan(tmp_path / "best.yaml")
    c = best["candidate"]
    assert (written.parallel.sharding, written.training.micro_batch_size, written.training.grad_accum_steps) == (
        c["strategy"],
        c["micro_batch"],
        c["grad_accum"],
    )
    assert (written.training.activation_checkpointing, written.training.compile) == (c["checkpointing"], c["compile"])
    assert written.predicted.tokens_per_s == round(best["predicted"]["tokens_per_s"], 1)
    assert written.predicted.intra_node_busbw_gbytes_s is not None  # what `llmctl plan` records too
    base = load_plan(plan)
    assert written.training.max_steps == base.training.max_steps and written.logging == base.logging
    assert written.model == base.model and written.data == base.data

    # The calibration file: `plan --calibrate` fits the efficiency to the best trial.
    cal_file = tmp_path / "best.tune.json"
    assert json.loads(cal_file.read_text())["trials"] == trials
    r = runner.invoke(
        app,
        ["plan", "llama-tiny", "--gpu", A100, "--gpus-per-node", "2", "--seq-len", "64", "--global-batch", "16"]
        + ["--precision", "fp32", "--no-write", "--json", "--calibrate", str(cal_file)],
    )
    assert r.exit_code == 0, r.output
    factor = json.loads(r.stdout)["calibration"]["factor"]
    assert factor == pytest.approx(best["measured"]["tokens_per_s"] / best["predicted"]["tokens_per_s"])

    # Never overwritten without --force: a second tune is refused before it runs anything.
    r = runner.invoke(app, [*args, "-o", "best.yaml", "--dir", "trials"])
    assert r.exit_code == 2 and "best.yaml already exists; nothing was run" in r.output
    assert len(list((tmp_path / "trials").iterdir())) == 1
    assert os.environ[tune_plans.FAIL_ENV] == "3"
