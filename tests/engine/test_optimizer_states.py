"""The optimizers behind `optimizer.states`: MomentsAdamW's math against torch's AdamW, torchao's AdamW8bit training a
toy problem, the memory ledger against what AdamW8bit really allocates (every rank of FSDP2 shard groups), and
torch.distributed.checkpoint round trips of the bf16 and 8-bit states."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")

from llmctl.engine import adamw_states  # noqa: E402
from llmctl.engine.adamw_states import MomentsAdamW  # noqa: E402
from llmctl.engine.optim import build_optimizer, check_installed  # noqa: E402
from llmctl.errors import InputError  # noqa: E402
from llmctl.plan.memory.ledger import adam_8bit_rank_bytes  # noqa: E402
from llmctl.spec.models import from_hf_config, from_preset  # noqa: E402
from llmctl.spec.planfile import OptimizerSection  # noqa: E402
from llmctl.spec.setup import TrainSetup  # noqa: E402
from tests.family_configs import LLAMA_256  # noqa: E402

WORKER = Path(__file__).with_name("optim_states_worker.py")
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="needs torchao (pip install 'llmctl[fp8]')"
)


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    return model.to(dtype)


def _train(make_opt, steps: int = 5, dtype=torch.float32) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    model = _model(dtype)
    opt = make_opt(model.parameters())
    for i in range(steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(i)).to(dtype)
        (model(x).float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]), opt


def test_fp32_moments_are_torch_adamw_exactly() -> None:
    ref, _ = _train(lambda p: torch.optim.AdamW(p, foreach=True, **HYPER))
    got, opt = _train(lambda p: MomentsAdamW(p, moments_dtype=torch.float32, **HYPER))
    assert torch.equal(got, ref)  # same foreach ops in the same order: bit for bit


def test_bf16_moments_follow_torch_adamw_within_bf16_rounding() -> None:
    """The same gradients into both (drawn, not computed from the weights, so only rounding differs)."""
    steps = 10
    grads = [torch.randn(64, 16, generator=torch.Generator().manual_seed(i)) for i in range(steps)]

    def run(make_opt):
        w = torch.nn.Parameter(torch.randn(64, 16, generator=torch.Generator().manual_seed(99)))
        opt = make_opt([w])
        for g in grads:
            w.grad = g.clone()
            opt.step()
        return w.detach(), opt.state[w]

    ref, ref_state = run(lambda p: torch.optim.AdamW(p, foreach=True, **HYPER))
    got, state = run(lambda p: MomentsAdamW(p, moments_dtype=torch.bfloat16, **HYPER))
    for k in ("exp_avg", "exp_avg_sq"):
        assert state[k].dtype == torch.bfloat16
        # Rounded to nearest when stored, each step: at most 2^-9 of the value each time, ten times.
        scale = ref_state[k].abs().max().item()
        torch.testing.assert_close(state[k].float(), ref_state[k], rtol=0, atol=steps * 2**-9 * scale)
    # Each step moves a weight by about lr; the rounded moments change that by a small part of it.
    assert (got - ref).abs().max() < 0.05 * HYPER["lr"]


def test_the_step_in_pieces_is_the_step_whole(monkeypatch) -> None:
    whole, _ = _train(lambda p: MomentsAdamW(p, moments_dtype=torch.bfloat16, **HYPER))
    monkeypatch.setattr(adamw_states, "CHUNK_NUMEL", 100)  # 64 x 16 weights cut in 11 pieces, chunks of a few
    pieces, _ = _train(lambda p: MomentsAdamW(p, moments_dtype=torch.bfloat16, **HYPER))
    assert torch.equal(pieces, whole)


def test_fp32_moments_over_pure_bf16_weights() -> None:
    """bf16 weights, fp32 moments: the moments are torch's AdamW's over the same (bf16) gradients exactly, and the
    weights its fp32 result rounded to bf16."""
    start = torch.randn(64, 16, generator=torch.Generator().manual_seed(99)).bfloat16()
    grads = [torch.randn(64, 16, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3)]
    ref_w, w = torch.nn.Parameter(start.float()), torch.nn.Parameter(start.clone())
    ref = torch.optim.AdamW([ref_w], foreach=True, **HYPER)
    opt = MomentsAdamW([w], moments_dtype=torch.float32, **HYPER)
    for g in grads:
        ref_w.data.copy_(w.data.float())  # from the same (rounded) weights each step
        ref_w.grad, w.grad = g.float(), g.clone()
        ref.step()
        opt.step()
        assert w.dtype == torch.bfloat16 and torch.equal(w.data, ref_w.data.bfloat16())
    for k in ("exp_avg", "exp_avg_sq"):
        assert opt.state[w][k].dtype == torch.float32
        torch.testing.assert_close(opt.state[w][k], ref.state[ref_w][k], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "states,dtype,kind",
    [
        ("auto", torch.float32, "AdamW"),
        ("fp32", torch.float32, "AdamW"),
        ("bf16", torch.bfloat16, "AdamW"),  # the weights' own dtype: torch's fused AdamW keeps bf16 moments
        ("bf16", torch.float32, "MomentsAdamW"),
        ("fp32", torch.bfloat16, "MomentsAdamW"),
        pytest.param("8bit", torch.float32, "AdamW8bit", marks=needs_torchao),
    ],
)
def test_build_optimizer_for_the_states(states, dtype, kind) -> None:
    opt = build_optimizer(_model(dtype), OptimizerSection(states=states), "cpu")
    assert type(opt).__name__ == kind
    if kind == "MomentsAdamW":
        assert opt.moments_dtype == (torch.bfloat16 if states == "bf16" else torch.float32)
    if kind == "AdamW8bit":
        assert isinstance(opt, adamw_states.torchao_optim().AdamW8bit)


def test_bf16_moments_under_a_beta2_they_cannot_follow_are_warned_about(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="llmctl.engine"):
        build_optimizer(_model(), OptimizerSection(states="bf16", betas=(0.9, 0.999)), "cpu")
    assert "exp_avg_sq's per-step decay (0.001) is under bf16's rounding step" in caplog.text


@needs_torchao
def test_8bit_adamw_trains_a_toy_problem() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)  # 4,096 weights: the smallest tensor torchao quantizes
    target = torch.randn(64, 64)
    opt = build_optimizer(model, OptimizerSection(states="8bit", lr=1e-2, weight_decay=0.0), "cpu")
    losses = []
    for i in range(30):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(i))
        loss = ((model(x) - x @ target.T) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert type(opt.state[model.weight]["exp_avg"]).__name__ == "OptimState8bit"
    assert losses[-1] < 0.7 * losses[0]


def test_8bit_without_torchao_is_one_line_naming_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(InputError, match="optimizer.states 8bit needs torchao") as e:
        build_optimizer(_model(), OptimizerSection(states="8bit"), "cpu")
    assert e.value.hint == "pip install 'llmctl[fp8]'"


@pytest.mark.parametrize("states", ["bf16", pytest.param("8bit", marks=needs_torchao)])
def test_the_states_are_sized_before_they_are_allocated(states) -> None:
    """What launch --dry-start can report without allocating: the bytes one step then allocates (a Linear of 4,096
    weights quantized, its bias and the norm's kept whole, steps included)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    opt = build_optimizer(model, OptimizerSection(states=states), "cpu")
    planned = adamw_states.planned_state_bytes(opt)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()

    def nbytes(t) -> int:
        return t.codes.nbytes + t.scale.nbytes + t.qmap.nbytes if hasattr(t, "codes") else t.nbytes

    assert planned == sum(nbytes(v) for st in opt.state.values() for v in st.values())
    assert adamw_states.planned_state_bytes(torch.optim.AdamW(model.parameters())) is None


def test_a_plan_with_8bit_states_is_refused_before_anything_is_built(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(InputError, match="optimizer.states 8bit needs torchao, which is not installed") as e:
        check_installed(OptimizerSection(states="8bit"))
    assert e.value.hint == "pip install 'llmctl[fp8]'"
    check_installed(OptimizerSection(states="bf16"))  # nothing more to install


TINY = LLAMA_256
# llama-3.1-8b's shapes (two of its identical blocks) over 8 ranks; a small Llama over 1, 3 and 8 ranks: over 3 ranks
# down_proj's shard (86 x 688 values) is no whole number of 256-blocks and stays fp32, and the last rank has fewer rows.
JOBS = [
    [TINY, 1, [0]],
    [TINY, 3, [0, 1, 2]],
    [TINY, 8, [0, 7]],
    [dict(from_preset("llama-3.1-8b").hf_config, num_hidden_layers=2), 8, [0, 7]],
]


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> dict:
    """One process for both (torch, transformers and torchao take seconds to import)."""
    tmp = tmp_path_factory.mktemp("optim-states")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    cmd = [sys.executable, str(WORKER), json.dumps(JOBS), str(tmp)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))


@needs_torchao
def test_the_8bit_ledger_is_what_adamw8bit_allocates(worker) -> None:
    """The ledger's figure is the largest rank's, to the byte."""
    got = worker["alloc"]
    for job, (config, world, ranks) in enumerate(JOBS):
        spec = from_hf_config(config, name="x")
        predicted = adam_8bit_rank_bytes(spec, TrainSetup(optimizer_states="8bit", gpus_per_node=world))
        measured = [got[f"{job}.{world}.{r}"] for r in ranks]
        assert max(measured) == predicted, (config["hidden_size"], world, measured, predicted)
    assert got["1.3.0"] != got["1.3.2"]  # the short last shard


@needs_torchao
def test_bf16_and_8bit_states_round_trip_through_dcp(worker) -> None:
    got = worker["dcp"]
    assert got["bf16"] == {
        "equal": True,
        "kinds": ["exp_avg:Tensor:torch.bfloat16", "exp_avg_sq:Tensor:torch.bfloat16", "step:Tensor:torch.float32"],
    }
    assert got["8bit"]["equal"] and "exp_avg:OptimState8bit:torch.float32" in got["8bit"]["kinds"]


# The engine run and resume with bf16 and 8-bit states joins the precision launch: tests/engine/test_precision_runs.py.
