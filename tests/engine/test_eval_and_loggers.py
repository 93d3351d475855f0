"""Validation loss (a fixed set of sequences, the same on any world size) and the TensorBoard / W&B sinks, one run
across a crash and a preemption."""

from __future__ import annotations

import importlib.util
import math
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from llmctl.engine.data import PackedBlocks
from llmctl.engine.evaluate import IGNORE, Evaluator
from llmctl.engine.loggers import scalars
from tests.engine.conftest import (
    CORPUS,
    REPO,
    check_ok,
    engine_cmd,
    engine_env,
    records,
    run_engine,
    run_engine_plans,
    write_plan,
)
from tests.engine.test_dist import _worker


def _val_file(folder: Path, blocks: int, seq_len: int = 64) -> Path:
    """Text whose byte tokens make exactly `blocks` blocks of seq_len (BOS + bytes + EOS)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = (CORPUS / sorted(p.name for p in CORPUS.iterdir())[0]).read_text()
    need = blocks * seq_len + 1 - 2
    f = folder / "val.txt"
    f.write_bytes((text.encode() * (need // len(text.encode()) + 1))[:need])
    return f


@pytest.mark.parametrize(("dp", "mbs", "acc"), [(1, 2, 2), (2, 2, 1), (4, 1, 1), (3, 1, 2)])
def test_every_sequence_of_the_set_is_evaluated_once_on_any_layout(dp: int, mbs: int, acc: int) -> None:
    """10 blocks, eval_batches 3 of a global batch of 4 (or 6): ranks together see blocks 0..9 once each, in equal
    numbers of micro-batches; the slots past the set carry only ignored targets."""
    tokens = np.arange(10 * 8 + 1, dtype=np.uint16)
    blocks = PackedBlocks(tokens, 8, seed=0, shuffle=False)
    seen: list[int] = []
    counts = set()
    for r in range(dp):
        mb = Evaluator(blocks, mbs, acc, r, dp, eval_batches=3).micro_batches()
        counts.add(len(mb))
        for b in mb:
            assert tuple(b.inputs.shape) == (mbs, 8)
            for row_in, row_t in zip(b.inputs.numpy(), b.targets.numpy(), strict=True):
                if (row_t == IGNORE).all():
                    continue
                assert (row_t != IGNORE).all()
                seen.append(int(row_in[0]) // 8)
                assert (row_t == row_in + 1).all()
    assert len(counts) == 1
    assert sorted(seen) == list(range(10))


def test_metric_names() -> None:
    rec = {"event": "step", "step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 10.0}
    rec |= {"tokens_per_s_predicted": 12.0, "mfu": None, "peak_rss_bytes": 7, "peak_rss_bytes_predicted": 9}
    assert scalars(rec) == {
        "train/loss": 2.5,
        "train/lr": 1e-3,
        "perf/tokens_per_s": 10.0,
        "predicted/tokens_per_s": 12.0,
        "memory/peak_rss_bytes": 7.0,
        "predicted/peak_rss_bytes": 9.0,
    }
    assert scalars({"event": "eval", "step": 3, "val_loss": 1.5, "val_ppl": math.exp(1.5)}) == {
        "eval/loss": 1.5,
        "eval/ppl": math.exp(1.5),
    }


LAYOUTS = ((1, 2, 2), (2, 2, 1), (4, 1, 1))
"""(ranks, micro-batch, accumulation): the same global batch of 4 sequences laid out three ways."""
PACKED_LAYOUTS = ((1, 2, 2), (2, 1, 2), (4, 1, 1))
"""The same for packed instruction data, with accumulation on 2 ranks (micro-batches of unequal loss tokens)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Path]]:
    """Every layout of LAYOUTS (plain validation) and PACKED_LAYOUTS (packed instruction data) run in ONE 4-rank
    torchrun, each plan on as many of its ranks as it is for (tests/engine/engine_runs.py): {"plain" | "packed":
    {ranks: plan}}."""
    from tests.engine.test_packed import packed_folder

    tmp = tmp_path_factory.mktemp("eval-runs")
    val = _val_file(tmp / "val", 10)
    plans: dict[str, dict[int, Path]] = {"plain": {}, "packed": {}}
    for nproc, mbs, acc in LAYOUTS:
        plans["plain"][nproc] = write_plan(
            tmp / f"w{nproc}",
            {
                "data": {"val": [str(val)]},
                "hardware": {"nproc_per_node": nproc},
                "training": {"max_steps": 2, "micro_batch_size": mbs, "grad_accum_steps": acc},
                "optimizer": {"lr": 1e-9},
                "logging": {"eval_interval_steps": 1, "eval_batches": 3},
            },
        )
    folder = packed_folder(tmp, n=200, val_fraction=0.1, seq_len=128)  # 2-3 examples a pack
    for nproc, mbs, acc in PACKED_LAYOUTS:
        plans["packed"][nproc] = write_plan(
            tmp / f"packed-w{nproc}",
            {
                "data": {"kind": "tokens", "paths": [str(folder)], "val": "split"},
                "hardware": {"nproc_per_node": nproc},
                "training": {"max_steps": 3, "micro_batch_size": mbs, "grad_accum_steps": acc, "seq_len": 128},
                "optimizer": {"lr": 1e-2, "warmup_steps": 0},
                "logging": {"eval_interval_steps": 3, "eval_batches": 1},
            },
        )
    every = [*plans["plain"].values(), *plans["packed"].values()]
    procs = run_engine_plans(every, 4, tmp)
    for plan in every:
        check_ok(procs[plan])
    return plans


@pytest.mark.dist
def test_validation_loss_is_the_same_on_1_2_and_4_ranks(runs: dict[str, dict[int, Path]]) -> None:
    """The same global batch of 4 laid out as 1 rank x mbs 2 x acc 2, 2 ranks x mbs 2, 4 ranks x mbs 1; a validation
    set of 10 blocks (eval_batches 3 asks for 12: two slots are padding). The learning rate is tiny so that the
    weights are the same to float rounding (this pins the evaluation, not training equality, which test_dist
    covers): the validation losses agree within 1e-6."""
    plans = runs["plain"]
    got = {}
    for nproc, plan in plans.items():
        assert records(plan, "start")[0]["world_size"] == nproc
        evals = records(plan, "eval")
        assert [e["step"] for e in evals] == [1, 2]
        assert all(e["val_sequences"] == 10 and e["val_tokens"] == 10 * 64 for e in evals)
        got[nproc] = [e["val_loss"] for e in evals]
        assert "10 blocks of 64" in records(plan, "start")[0]["val"]
    for nproc in (2, 4):
        for a, b in zip(got[nproc], got[1], strict=True):
            assert a == pytest.approx(b, abs=1e-6, rel=0), got
    assert 4.0 < got[1][0] < 7.0  # near ln(320) = 5.77 at initialization


@pytest.mark.dist
def test_packed_data_trains_the_same_on_any_layout(runs: dict[str, dict[int, Path]]) -> None:
    """Packed instruction data (masked prompts, documents restarting their positions) through the real engine: each
    step's gradient is the mean over the global batch's loss tokens, so 1 rank x mbs 2 x acc 2, 2 ranks x mbs 1 x
    acc 2 and 4 ranks x mbs 1 give the same gradient norm, the same losses after two real updates (lr 1e-2), the same
    share of loss tokens and the same validation loss. A per-micro-batch mean, or a divisor without dp (FSDP2
    averages the ranks' gradients), changes the gradient norm of the 2- and 4-rank runs."""
    plans = runs["packed"]
    steps = {n: records(p, "step") for n, p in plans.items()}
    for n, plan in plans.items():
        start = records(plan, "start")[0]
        assert start["world_size"] == n and "examples packed in" in start["data"]
        assert 0.05 < start["loss_token_fraction"] < 0.5
        assert [r["step"] for r in steps[n]] == [1, 2, 3]
        assert all(0 < r["loss_token_fraction"] < 1 for r in steps[n])
    for n in (2, 4):
        for a, b in zip(steps[n], steps[1], strict=True):
            assert a["loss_token_fraction"] == b["loss_token_fraction"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (n, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (n, a["step"])
        assert records(plans[n], "eval")[0]["val_loss"] == pytest.approx(
            records(plans[1], "eval")[0]["val_loss"], rel=1e-5
        )
    assert steps[1][2]["loss"] < steps[1][0]["loss"]  # it learns
    ev = records(plans[1], "eval")[0]
    assert 0 < ev["val_tokens"] < ev["val_sequences"] * 128 / 4  # only the replies are targets


def _tensorboard_steps(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.dist
def test_one_tensorboard_and_wandb_run_across_a_crash_and_a_preemption(tmp_path: Path) -> None:
    """Three attempts of one 2-rank run, TensorBoard and W&B (offline) on: (1) rank 0 dies in the middle of the
    step-6 save after logging steps 4-6 (checkpoint every 3 steps); (2) the restart resumes at step 3, relogs 4-6 and
    is preempted (SIGTERM) at step 7 or later; (3) the restart finishes. TensorBoard reads one run with steps 1..12,
    each once, equal to metrics.jsonl's last value for that step; W&B wrote one run id for all three attempts; the
    API key from the environment is in no file."""
    for mod in ("tensorboard", "wandb"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} not installed (pip install 'llmctl[logging]')")
    secret = "llmctl-test-wandb-key-0123456789abcdef"
    env = {"WANDB_API_KEY": secret, "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    plan = write_plan(
        tmp_path,
        {
            "data": {"val": [str(_val_file(tmp_path / "val", 4))]},
            "training": {"max_steps": 12},
            "checkpoint": {"interval_steps": 3},
            "logging": {
                "tensorboard": True,
                "wandb": {"project": "llmctl-test", "mode": "offline"},
                "eval_interval_steps": 4,
                "eval_batches": 1,
            },
        },
        ckpt=True,
    )
    crashed = run_engine(plan, 2, tmp_path, {**env, "LLMCTL_ENGINE_TEST_CRASH_IN_SAVE": "6"})
    assert crashed.returncode != 0
    assert max(r["step"] for r in records(plan, "step")) == 6

    metrics = plan.parent / "logs" / "metrics.jsonl"
    proc = subprocess.Popen(
        engine_cmd(plan, 2), cwd=REPO, env=engine_env(tmp_path, env), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline, sent = time.time() + 180, False
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(records(plan, "start")) == 2 and any(r["step"] >= 7 for r in records(plan, "step")):
            worker = _worker(proc, rank=1)
            assert worker is not None
            worker.send_signal(signal.SIGTERM)
            sent = True
            break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=180)
    assert sent and proc.returncode == 0, out[-4000:]
    assert len(records(plan, "stop")) == 1
    check_ok(run_engine(plan, 2, tmp_path, env))

    starts = records(plan, "start")
    assert [s["step"] for s in starts][:2] == [0, 3] and len(starts) == 3
    assert len({s["run_id"] for s in starts}) == 1
    last = {r["step"]: r["loss"] for r in records(plan, "step")}  # later lines win: the attempt that counted
    tb = _tensorboard_steps(plan.parent / "logs" / "tensorboard", "train/loss")
    assert [s for s, _ in tb] == list(range(1, 13)), tb
    for s, v in tb:
        assert v == pytest.approx(last[s], rel=1e-6)
    assert [s for s, _ in _tensorboard_steps(plan.parent / "logs" / "tensorboard", "eval/loss")] == [4, 8, 12]

    runs = sorted((plan.parent / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 3, runs
    assert {r.name.rsplit("-", 1)[1] for r in runs} == {starts[0]["run_id"]}
    for f in tmp_path.rglob("*"):
        if f.is_file() and f.stat().st_size < 50_000_000:
            assert secret.encode() not in f.read_bytes(), f


def test_a_logger_that_is_not_installed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmctl.engine import loggers
    from llmctl.errors import InputError
    from llmctl.spec.planfile import LoggingSection

    real = importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda m: None if m == "wandb" else real(m))
    loggers.check_installed(LoggingSection(tensorboard=True))
    with pytest.raises(InputError, match=r"logging.wandb: the wandb package is not installed") as e:
        loggers.check_installed(LoggingSection(wandb={"project": "p"}))
    assert "llmctl[logging]" in (e.value.hint or "")


def test_a_plan_cannot_hold_the_wandb_key() -> None:
    from llmctl.errors import SpecError
    from llmctl.spec.planfile import plan_from_dict

    plan = {"model": {"preset": "llama-tiny"}, "training": {"max_steps": 1}}
    with pytest.raises(SpecError, match="logging.wandb.api_key: unknown key"):
        plan_from_dict({**plan, "logging": {"wandb": {"project": "p", "api_key": "x"}}})
