"""Real torchrun runs of the engine on gloo (CPU): sharding, loss, grad accumulation, preemption, crash recovery."""

from __future__ import annotations

import math
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from llmctl.engine.trainer import GRADS_PROBE_ENV
from tests.engine.conftest import (
    REPO,
    check_ok,
    engine_cmd,
    engine_env,
    losses,
    records,
    run_engine,
    run_engine_plans,
    write_plan,
)

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytestmark = pytest.mark.dist


def assert_loss_falls(loss: dict[int, float]) -> None:
    steps = sorted(loss)
    first = sum(loss[s] for s in steps[:3]) / 3
    last = sum(loss[s] for s in steps[-3:]) / 3
    assert all(math.isfinite(v) for v in loss.values())
    # Uniform over 320 tokens is ln(320) = 5.77; bytes of English text fall well below it within 30 steps.
    assert first > 5.0 and last < first - 1.5, (first, last)


def test_full_shard_2_ranks_loss_falls(reference_run: Path) -> None:
    start = records(reference_run, "start")[0]
    assert start["mesh"] == [2] and start["mesh_dims"] == ["shard"] and start["backend"] == "gloo"
    assert start["attention"] == "sdpa" and start["vocab_size"] == 320
    # On a CPU nothing is chosen; SDPA's own CPU kernel (flash-style for fp32 causal attention) is named
    assert start["sdpa"] == {"priced": None, "order": [], "runs": "cpu-flash", "why": None}
    loss = losses(reference_run)
    assert sorted(loss) == list(range(1, 31))
    assert_loss_falls(loss)
    last = records(reference_run, "step")[-1]
    assert last["tokens_per_s"] > 0 and last["peak_rss_bytes"] > 0 and last["mfu"] is None
    assert last["model_tflops_per_gpu"] > 0
    assert last["hardware_tflops_per_gpu"] == pytest.approx(last["model_tflops_per_gpu"])


Runs = dict[str, tuple[Path, subprocess.CompletedProcess[str]]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """name -> (plan, its run): the uninterrupted runs besides the reference run, made one after the other in one
    4-rank torchrun through the engine's entry point (tests/engine/engine_runs.py: a torchrun costs ~10 s of CPU,
    these runs a few seconds each), each on as many ranks as its plan is for. The reference run and the interrupted
    runs are torchruns of their own."""
    root = tmp_path_factory.mktemp("runs")
    # Clipping far above the norm: it cannot hide a gradient-scale bug (clipping at 1.0 brought an undivided
    # accumulation to the same update), and the logged grad_norm is the unclipped norm to compare.
    accumulated = {"micro_batch_size": 1, "grad_accum_steps": 2, "grad_clip": 1000.0}
    plans = {
        "hybrid-2x2": write_plan(
            root / "hybrid-2x2",
            {
                "hardware": {"nodes": 2, "nproc_per_node": 2},
                "parallel": {"sharding": "hybrid_shard"},
                "training": {"micro_batch_size": 2, "max_steps": 25},
            },
        ),
        "mbs2": write_plan(root / "mbs2", {"training": {"max_steps": 6, "micro_batch_size": 2, "grad_clip": 1000.0}}),
        "acc2": write_plan(root / "acc2", {"training": {"max_steps": 6, **accumulated}}),
        "noshard-acc2": write_plan(
            root / "noshard-acc2", {"parallel": {"sharding": "no_shard"}, "training": {"max_steps": 6, **accumulated}}
        ),
        "noshard": write_plan(root / "noshard", {"parallel": {"sharding": "no_shard"}}),
        **pipeline_plans(root),
    }
    # Every run writes its first step's whole gradients (logs/grads): the pipeline runs are held against mbs2's.
    procs = run_engine_plans(list(plans.values()), 4, root, extra_env={GRADS_PROBE_ENV: "1"})
    return {name: (plan, procs[plan]) for name, plan in plans.items()}


PIPELINES = {
    # name: (ranks, schedule, {cp or tp}): pp 2 alone (dp 1), pp 2 x FSDP 2, pp 2 x cp 2 and pp 2 x tp 2 (dp 1: the
    # ring or the tp plan inside each stage), each at mbs2's global batch of 4 sequences
    "pp2-1f1b": (2, "1f1b", {}),
    "pp2-interleaved": (2, "interleaved-1f1b", {}),
    "pp2x2-1f1b": (4, "1f1b", {}),
    "pp2x2-interleaved": (4, "interleaved-1f1b", {}),
    "pp2xcp2-interleaved": (4, "interleaved-1f1b", {"cp": 2}),
    # tp: the stages hand on the whole sequence; the head-only stage's norm cuts it to its tokens again. (No other
    # tp plan runs before it in this launch: torch caches DTensor collectives by a mesh's ranks and names, and a
    # process group of an earlier run in the same process with the same tp ranks is gone; one run per process, as the
    # engine runs, never meets that.)
    "pp2xtp2-interleaved": (4, "interleaved-1f1b", {"tp": 2}),
    "pp2-gpipe": (2, "gpipe", {}),
    "pp2x2-zbv": (4, "zbv", {}),  # ZB-V: stages 0 and 3 on pp rank 0, backward split into input and weight parts
}


def pipeline_plans(root: Path) -> dict[str, Path]:
    """mbs2's run (2 layers, 6 steps, clipping far above the norm) under pipeline parallelism: 2 accumulation
    micro-batches per step through one schedule run. Interleaved 1F1B on 2 layers makes 4 stages: the embedding
    alone, one block each, the norm and head alone (split_layers)."""
    out = {}
    for name, (ranks, sched, inner) in PIPELINES.items():
        dp = ranks // (2 * inner.get("cp", 1) * inner.get("tp", 1))
        out[name] = write_plan(
            root / name,
            {
                "hardware": {"nproc_per_node": ranks},
                "parallel": {"pp": 2, "pp_schedule": sched, **inner},
                "training": {"max_steps": 6, "micro_batch_size": 2 // dp, "grad_accum_steps": 2, "grad_clip": 1000.0},
            },
        )
    return out


def first_grads(plan: Path) -> dict[str, torch.Tensor]:
    """The whole gradients of the run's first step, every rank's parameters (GRADS_PROBE_ENV)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted((plan.parent / "logs" / "grads").glob("grads-rank*.pt")):
        out.update(torch.load(f))
    return out


def finished(runs: Runs, name: str) -> Path:
    """The plan of a run that finished (exit 0)."""
    plan, proc = runs[name]
    check_ok(proc)
    return plan


def test_hybrid_2x2_4_ranks_loss_falls(runs: Runs) -> None:
    plan = finished(runs, "hybrid-2x2")
    start = records(plan, "start")[0]
    assert start["world_size"] == 4
    assert start["mesh"] == [2, 2] and start["mesh_dims"] == ["replicate", "shard"]
    assert_loss_falls(losses(plan))


def test_grad_accumulation_equivalence(runs: Runs) -> None:
    """mbs 2 x acc 1 and mbs 1 x acc 2 see the same samples per step: same losses within 1e-5 (fp32)."""
    a, b = finished(runs, "mbs2"), finished(runs, "acc2")
    la, lb = losses(a), losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, 7))
    for s in la:
        assert la[s] == pytest.approx(lb[s], abs=1e-5, rel=0), (s, la[s], lb[s])
    assert la[6] < la[1]  # the steps did update the model (a later loss differs)
    # The gradients themselves: the mean over the step's samples either way (loss / acc per micro-batch), so the
    # same global norm at every step; an undivided accumulation doubles it.
    na = {r["step"]: r["grad_norm"] for r in records(a, "step")}
    nb = {r["step"]: r["grad_norm"] for r in records(b, "step")}
    assert all(v > 0 for v in na.values()) and na.keys() == nb.keys()
    for s in na:
        assert nb[s] == pytest.approx(na[s], rel=1e-4), (s, na[s], nb[s])
    # Accumulation on a replicated mesh (no_shard = (world, 1) HSDP): reduce-scatter every micro-batch, the
    # cross-replica all-reduce skipped until the last one (set_requires_all_reduce). Same losses.
    c = finished(runs, "noshard-acc2")
    lc = losses(c)
    for s in la:
        assert lc[s] == pytest.approx(la[s], abs=1e-4, rel=0), (s, lc[s], la[s])
    nc = {r["step"]: r["grad_norm"] for r in records(c, "step")}
    for s in na:
        assert nc[s] == pytest.approx(na[s], rel=1e-3), (s, na[s], nc[s])


def _worker(torchrun: subprocess.Popen[str], rank: int) -> psutil.Process | None:
    for child in psutil.Process(torchrun.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "llmctl.engine" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def test_sigterm_then_restart_is_bit_exact(tmp_path: Path, reference_run: Path) -> None:
    """SIGTERM to one rank: all ranks stop at the same step, save, exit 0; the restart reproduces the
    uninterrupted run's losses bit for bit."""
    plan = write_plan(tmp_path, {"checkpoint": {"interval_steps": 1000}}, ckpt=True)
    metrics = plan.parent / "logs" / "metrics.jsonl"
    proc = subprocess.Popen(
        engine_cmd(plan, 2),
        cwd=REPO,
        env=engine_env(tmp_path),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 180
    sent = False
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(r["step"] >= 5 for r in records(plan, "step")):
            worker = _worker(proc, rank=1)
            assert worker is not None
            worker.send_signal(signal.SIGTERM)  # only rank 1 gets it: the ranks must agree among themselves
            sent = True
            break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=180)
    assert sent, out[-3000:]
    assert proc.returncode == 0, out[-5000:]
    stop = records(plan, "stop")
    assert len(stop) == 1, out[-3000:]
    k = stop[0]["step"]
    assert 5 <= k < 30
    assert (plan.parent / "ckpt" / f"step_{k:08d}").is_dir()

    check_ok(run_engine(plan, 2, tmp_path))
    starts = records(plan, "start")
    assert starts[-1]["step"] == k
    resumed = {r["step"]: r["loss"] for r in records(plan, "step")}
    ref = losses(reference_run)
    assert sorted(resumed) == sorted(ref)
    for s in range(1, 31):
        assert resumed[s] == ref[s], (s, resumed[s], ref[s])  # bit for bit, before and after the resume


def test_sigkill_in_the_middle_of_a_save(tmp_path: Path, reference_run: Path) -> None:
    """Rank 0 is SIGKILLed after the step-10 shards are written, before the rename: the step-5 checkpoint
    stays intact, the partial folder is ignored and removed, and the run resumes from step 5."""
    plan = write_plan(tmp_path, {"checkpoint": {"interval_steps": 5, "keep_last": 1}}, ckpt=True)
    ckpt = plan.parent / "ckpt"
    crashed = run_engine(plan, 2, tmp_path, extra_env={"LLMCTL_ENGINE_TEST_CRASH_IN_SAVE": "10"})
    assert crashed.returncode != 0
    assert (ckpt / "step_00000005").is_dir() and (ckpt / ".tmp-step_00000010").is_dir()
    assert not (ckpt / "step_00000010").exists()

    check_ok(run_engine(plan, 2, tmp_path))
    assert records(plan, "start")[-1]["step"] == 5
    assert not (ckpt / ".tmp-step_00000010").exists()
    # keep_last 1; the run's lock file (llmctl.launch.runlock) stays beside the checkpoints
    assert sorted(p.name for p in ckpt.iterdir() if p.name != ".llmctl-run.lock") == ["step_00000030"]
    resumed = [r for r in records(plan, "step")]
    after = {r["step"]: r["loss"] for r in resumed[-25:]}
    ref = losses(reference_run)
    assert sorted(after) == list(range(6, 31))
    assert all(after[s] == ref[s] for s in after)


def test_no_shard_equals_full_shard(runs: Runs, reference_run: Path) -> None:
    """no_shard is a (world, 1) HSDP mesh (DDP semantics): same math as FULL, same losses within fp32 noise."""
    plan = finished(runs, "noshard")
    start = records(plan, "start")[0]
    assert start["mesh"] == [2, 1] and start["mesh_dims"] == ["replicate", "shard"]
    ref, got = losses(reference_run), losses(plan)
    for s in (1, 2, 3, 10, 30):
        assert got[s] == pytest.approx(ref[s], abs=1e-4), (s, got[s], ref[s])


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_trains_as_data_parallelism(runs: Runs, name: str) -> None:
    """pp 2 (1F1B, interleaved 1F1B, GPipe, ZB-V; alone, x FSDP 2, x cp 2, x tp 2) at the same global batch as FSDP alone
    (mbs2): the same losses and gradient norms for 6 steps (fp32, within 1e-5), and every parameter's whole gradient
    after the first step the same (within 1e-6): a loss or gradient scaled by the micro-batch count, a stage's
    gradient left out of the norm, or a token counted twice would show."""
    ref, plan = finished(runs, "mbs2"), finished(runs, name)
    ranks, sched, _ = PIPELINES[name]
    start = records(plan, "start")[0]
    assert start["pp"] == 2 and start["pp_schedule"] == sched and start["world_size"] == ranks
    assert start["mesh_dims"][0] == "pp" and start["pp_stages"] == (4 if sched in ("interleaved-1f1b", "zbv") else 2)
    la, lb = losses(ref), losses(plan)
    assert sorted(la) == sorted(lb) == list(range(1, 7))
    for s in la:
        assert abs(la[s] - lb[s]) <= 1e-5, (s, la, lb)
    na = {r["step"]: r["grad_norm"] for r in records(ref, "step")}
    nb = {r["step"]: r["grad_norm"] for r in records(plan, "step")}
    for s in na:
        assert abs(na[s] - nb[s]) <= 1e-5 * max(1.0, na[s]), (s, na, nb)
    ga, gb = first_grads(ref), first_grads(plan)
    assert ga and sorted(ga) == sorted(gb)
    for k, g in ga.items():
        worst = float((g - gb[k]).abs().max())
        assert worst <= 1e-6, f"{k}: gradients differ by {worst:.2e}"
