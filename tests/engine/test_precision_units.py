"""fp16's loss scaler against torch.amp.GradScaler, the unscale-then-clip order, and torchao's float8 conversion of a
model built on the meta device (which layers, why the others stay in bf16, float8 all-gather only where tensorwise).
The runs under torchrun are in test_precision_runs.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmctl.engine.scaler import GradStep, LossScaler, grad_norm
from llmctl.errors import InputError
from llmctl.spec.precision import policy
from tests.engine.conftest import TINY, write_plan

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")


def _grads(step: int) -> list[torch.Tensor]:
    """Step `step`'s gradients for two parameters; steps 2 and 3 overflow (an inf, then a NaN)."""
    g = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (0.1 * (step + 1))
    h = torch.full((4,), -0.05 * step)
    if step == 2:
        g[0, 1] = float("inf")
    if step == 3:
        h[2] = float("nan")
    return [g, h]


def test_the_scaler_follows_torch_grad_scaler_step_for_step() -> None:
    """Same scaled gradients into GradScaler (cpu) and our GradStep over 9 steps with a growth interval of 2: the same
    scale after every step, the same steps skipped, and the same parameters after SGD (so the same unscale)."""
    ours_p = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)]
    ref_p = [p.detach().clone().requires_grad_(True) for p in ours_p]
    ours_opt, ref_opt = torch.optim.SGD(ours_p, lr=0.5), torch.optim.SGD(ref_p, lr=0.5)
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    step = GradStep(None, LossScaler(scale=1024.0, growth_interval=2))
    for k in range(9):
        ref_scale = ref.scale(torch.ones(())).item()  # what GradScaler multiplies the loss by this step
        assert step.loss_multiplier == ref_scale, k
        for p, q, g in zip(ours_p, ref_p, _grads(k), strict=True):
            p.grad = g * step.loss_multiplier
            q.grad = g * ref_scale
        stepping, norm = step(ours_p)
        if stepping:
            ours_opt.step()
        ref.step(ref_opt)
        ref.update()
        assert stepping == (k not in (2, 3)), k
        if stepping:
            assert norm == pytest.approx(torch.linalg.vector_norm(torch.cat([g.flatten() for g in _grads(k)])))
        assert step.scaler.scale == ref.get_scale(), k
        for p, q in zip(ours_p, ref_p, strict=True):
            assert torch.equal(p.detach(), q.detach()), k
        ours_opt.zero_grad()
        ref_opt.zero_grad()
    assert step.scaler.skipped_steps == 2
    assert step.scaler.scale == 1024.0 * 2 * 0.25 * 2 * 2  # grown after step 1, two back-offs, grown after 5 and 7


def test_clipping_applies_to_the_unscaled_gradients() -> None:
    """With scale 2**10 and clip 1.0: the gradients after the step are clip_grad_norm_(g, 1.0) of the *unscaled* g (a
    clip before the unscale would leave them 2**10 times too small), and the norm reported is the unscaled one."""
    g = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]  # norm 13
    params = [torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)]
    for p, x in zip(params, g, strict=True):
        p.grad = x * 1024.0
    stepping, norm = GradStep(1.0, LossScaler(scale=1024.0))(params)
    assert stepping and norm == pytest.approx(13.0)
    assert torch.allclose(torch.cat([p.grad for p in params]), torch.tensor([3.0, 4.0, 12.0]) / 13.0, atol=1e-6)
    # Without a scaler the same step is torch's clip_grad_norm_.
    for p, x in zip(params, g, strict=True):
        p.grad = x.clone()
    stepping, norm = GradStep(1.0, None)(params)
    assert stepping and norm == pytest.approx(13.0) and grad_norm([p.grad for p in params]) == pytest.approx(1.0)


def _verdict(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    norm = torch.tensor(float("inf") if rank == 1 else 3.0)  # only rank 1's shard overflowed
    Path(f"{out}.{rank}").write_text(str(LossScaler().found_overflow(norm)))
    dist.destroy_process_group()


def test_the_overflow_verdict_is_agreed_by_every_rank(tmp_path: Path) -> None:
    """Rank 0's gradients are finite, rank 1's are not: both skip (a rank that stepped alone would desynchronise
    the replicas' weights)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "verdict")
    mp.start_processes(_verdict, args=(str(tmp_path / "store"), out), nprocs=2, start_method="fork")
    assert [Path(f"{out}.{r}").read_text() for r in (0, 1)] == ["True", "True"]


def test_scaler_state_round_trips_and_ignores_unknown_keys() -> None:
    a = LossScaler(scale=4096.0, clean_steps=17, skipped_steps=3)
    b = LossScaler()
    b.load_state_dict({**a.state_dict(), "from_a_newer_version": 1})
    assert b == a and isinstance(b.scale, float) and isinstance(b.clean_steps, int)


def _tiny_meta(tmp: Path, overrides: dict[str, Any] | None = None, preset: str = "llama-tiny") -> torch.nn.Module:
    """The engine's own model build (llmctl.engine.model.build_meta_model) of a tiny plan, on the meta device."""

    return _meta(tmp, {"preset": preset, "overrides": overrides or {}})


def _meta(tmp: Path, model: dict[str, Any]) -> torch.nn.Module:
    """build_meta_model of the tiny test plan with its `model` section replaced."""
    from llmctl.engine.model import build_meta_model, model_spec_for
    from llmctl.spec.planfile import load_plan

    plan = write_plan(tmp)
    raw = yaml.safe_load(plan.read_text())
    raw["model"] = model
    plan.write_text(yaml.safe_dump(raw))
    built = load_plan(plan)
    return build_meta_model(model_spec_for(built.model), built.setup, "sdpa")


def test_float8_converts_the_linear_layers_but_the_head_and_odd_shapes(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="needs torchao (pip install 'llmctl[fp8]')")
    from torchao.float8.float8_linear import Float8Linear

    from llmctl.engine import float8

    model = _tiny_meta(tmp_path, TINY["model"]["overrides"])  # hidden 64, intermediate 172
    conv = float8.convert(model, policy("fp8"), fsdp=True)
    layers = dict(model.named_modules())
    # q, k, v, o of every layer are 64-wide (16 | 64); the MLP's 172 is not a multiple of 16; the head never.
    assert all(isinstance(layers[n], Float8Linear) for n in conv.converted)
    assert {n.rsplit(".", 1)[-1] for n in conv.converted} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert conv.skipped["lm_head"] == "LM head" and not isinstance(layers["lm_head"], Float8Linear)
    mlp = [n for n in conv.skipped if ".mlp." in n]
    assert mlp and all(conv.skipped[n] == "not a multiple of 16" for n in mlp)
    assert conv.all_gather and layers[conv.converted[0]].config.enable_fsdp_float8_all_gather
    assert float8.scale_precompute(conv) is not None

    rowwise = float8.convert(_tiny_meta(tmp_path / "r"), policy("fp8-rowwise"), fsdp=True)
    assert not rowwise.all_gather and float8.scale_precompute(rowwise) is None
    assert float8.convert(_tiny_meta(tmp_path / "b"), policy("bf16-mixed"), fsdp=True) is None


def test_float8_all_gathers_only_under_fsdp(tmp_path: Path) -> None:
    """The float8 all-gather is FSDP2's: without FSDP (one rank, no_shard) the tensorwise layers keep their bf16
    weights whole, so no layer is set to gather in float8, nothing precomputes scales after the optimizer step (no
    amax all-reduce) and the start event says so; the same conversion under FSDP sets every converted layer."""
    pytest.importorskip("torchao", reason="needs torchao (pip install 'llmctl[fp8]')")
    from llmctl.engine import float8

    for fsdp in (False, True):
        model = _tiny_meta(tmp_path / str(fsdp), TINY["model"]["overrides"])
        conv = float8.convert(model, policy("fp8"), fsdp=fsdp)
        layers = dict(model.named_modules())
        assert conv.all_gather is fsdp
        assert [layers[n].config.enable_fsdp_float8_all_gather for n in conv.converted] == [fsdp] * len(conv.converted)
        assert (float8.scale_precompute(conv) is not None) is fsdp
        assert ("(float8 weight all-gather)" in conv.summary()) is fsdp
        assert float8.describe(model, conv)["float8_layers"] == len(conv.converted) > 0


def test_float8_leaves_an_nn_linear_router_in_bf16() -> None:
    """Under transformers 4.x Mixtral's and Qwen3-MoE's router is an nn.Linear named `gate` (transformers 5 made it a
    router module, which float8 never converts), gpt-oss's and Llama 4's `router`: kept in bf16 by name even where its
    shape (16 experts) passes the shape rule; a dense MLP's `gate_proj` converts."""
    pytest.importorskip("torchao", reason="needs torchao (pip install 'llmctl[fp8]')")
    from llmctl.engine import float8

    def block() -> torch.nn.Module:
        mlp = torch.nn.Module()
        mlp.gate, mlp.router, mlp.gate_proj = (torch.nn.Linear(64, n, bias=False) for n in (16, 16, 128))
        return mlp

    with torch.device("meta"):
        model = torch.nn.ModuleDict({"mlp": block(), "lm_head": torch.nn.Linear(64, 256, bias=False)})
    model.get_output_embeddings = lambda: model["lm_head"]
    conv = float8.convert(model, policy("fp8"), fsdp=True)
    assert conv.converted == ["mlp.gate_proj"]
    assert conv.skipped == {"mlp.gate": "MoE router", "mlp.router": "MoE router", "lm_head": "LM head"}


def _tp_styles(tmp: Path, precision: str, intermediate: int) -> dict[str, str]:
    """{path in a decoder layer: the class name of its TP style} for the tiny Llama converted under `precision`."""
    from llmctl.engine import float8
    from llmctl.engine.tensor_parallel import _layer_styles
    from llmctl.families import family_of
    from llmctl.families.modules import decoder_layers

    model = _tiny_meta(tmp, {**TINY["model"]["overrides"], "intermediate_size": intermediate})
    float8.convert(model, policy(precision), fsdp=True)
    styles = _layer_styles(decoder_layers(model)[0], dict(family_of("llama").tp_plan))
    return {path: type(st).__name__ for path, st in styles.items()}


def test_float8_linears_take_torchaos_float8_tp_styles(tmp_path: Path) -> None:
    """Under tensorwise float8 each converted linear takes torchao's float8 style of its split, and an input whose
    consumers are all converted is cast before its all-gather (PrepareFloat8ModuleInput: q, k, v; gate, up), as
    torchtitan's parallelize_llama; a linear left in bf16 (the MLP's 172 columns) keeps torch's style, and so does
    every rowwise-scaled one (torchao's float8 styles assume one scale per tensor)."""
    pytest.importorskip("torchao", reason="needs torchao (pip install 'llmctl[fp8]')")
    attention = {
        "self_attn": "PrepareFloat8ModuleInput",
        **{f"self_attn.{p}_proj": "Float8ColwiseParallel" for p in "qkv"},
        "self_attn.o_proj": "Float8RowwiseParallel",
    }
    mlp = {
        "mlp": "PrepareFloat8ModuleInput",
        "mlp.gate_proj": "Float8ColwiseParallel",
        "mlp.up_proj": "Float8ColwiseParallel",
        "mlp.down_proj": "Float8RowwiseParallel",
    }
    norms = {"input_layernorm": "SequenceParallel", "post_attention_layernorm": "SequenceParallel"}
    assert _tp_styles(tmp_path / "a", "fp8", 128) == {**norms, **attention, **mlp}
    bf16_mlp = {
        "mlp": "PrepareModuleInput",
        "mlp.gate_proj": "ColwiseParallel",
        "mlp.up_proj": "ColwiseParallel",
        "mlp.down_proj": "RowwiseParallel",
    }
    assert _tp_styles(tmp_path / "b", "fp8", 172) == {**norms, **attention, **bf16_mlp}
    plain = _tp_styles(tmp_path / "c", "bf16-mixed", 128)
    assert _tp_styles(tmp_path / "d", "fp8-rowwise", 128) == plain
    assert not any("Float8" in v for v in plain.values())


def test_float8_refuses_a_model_with_nothing_to_convert(tmp_path: Path) -> None:
    pytest.importorskip("torchao", reason="needs torchao (pip install 'llmctl[fp8]')")
    from llmctl.engine import float8

    with pytest.raises(InputError, match="GPT2LMHeadModel has no nn.Linear layer float8 can run"):
        float8.convert(_tiny_meta(tmp_path, preset="gpt2-tiny"), policy("fp8"), fsdp=True)


def test_float8_without_torchao_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from llmctl.engine import float8

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(InputError, match="float8 training needs torchao") as e:
        float8.convert(_tiny_meta(tmp_path), policy("fp8"), fsdp=True)
    assert "llmctl[fp8]" in (e.value.hint or "")


EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _family_cases() -> list[tuple[str, dict[str, int]]]:
    """Every family's tiny config, and each MoE one again with 16 experts (a router 16 wide passes the shape rule:
    only the router rule keeps it in bf16)."""
    from llmctl.families import REGISTRY
    from tests.family_configs import MOE, tiny

    cases: list[tuple[str, dict[str, int]]] = [(mt, {}) for mt in sorted(REGISTRY)]
    for mt in MOE:
        cases += [(mt, {k: 16}) for k in EXPERT_KEYS if k in tiny(mt)]
    return cases


@pytest.mark.parametrize(("model_type", "over"), _family_cases())
def test_the_engine_converts_the_layers_the_cost_model_prices(
    tmp_path: Path, model_type: str, over: dict[str, int]
) -> None:
    """For every analytical family's tiny config (and the MoE ones with 16 experts): the engine's Float8Linear layers are exactly as many as llmctl.plan.float8 prices on float8 tensor cores, and a
    model with none is refused by both (the planner's and the engine's filters are two readings of one rule)."""
    pytest.importorskip("torchao", reason="needs torchao (pip install 'llmctl[fp8]')")
    import json

    from llmctl.engine import float8
    from llmctl.plan.float8 import linear_count
    from llmctl.spec.models import from_hf_config
    from tests.family_configs import tiny

    cfg = tiny(model_type, **over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    expected = linear_count(from_hf_config(cfg, name=model_type))
    model = _meta(tmp_path / "run", {"config": str(tmp_path / "config.json")})
    if expected == 0:
        with pytest.raises(InputError, match="has no nn.Linear layer float8 can run"):
            float8.convert(model, policy("fp8"), fsdp=True)
        return
    conv = float8.convert(model, policy("fp8"), fsdp=True)
    assert len(conv.converted) == expected, (conv.converted, conv.skipped)
