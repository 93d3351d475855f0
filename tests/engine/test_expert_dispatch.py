"""The dispatching experts forward (llmctl.engine.experts.dispatch_forward) in one process (an ep group of one, gloo):
the sort by expert, the counts exchange, the regrouping by local expert, the two grouped GEMMs with each family's
layout (Qwen3-MoE; gpt-oss: transposed weights, interleaved gate/up, biases; DeepSeek-V3), the combine's weighting
and the order back: outputs and every gradient equal transformers' own experts loop. The multi-rank splits are
tests/engine/test_expert_parallel.py's (a 4-rank launch)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

import torch.distributed as dist  # noqa: E402

from llmctl.engine.experts import ExpertGroup, _grad_scaled, dispatch_forward, experts_modules  # noqa: E402
from tests.family_configs import tiny  # noqa: E402


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _experts(family: str) -> torch.nn.Module:
    cfg = tiny(family)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    m = experts_modules(model)[0]
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)  # biases too (gpt-oss initializes them to zero)
    return m


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_dispatch_equals_the_experts_loop(group, family: str) -> None:
    m = _experts(family)
    e = m.num_experts
    gen = torch.Generator().manual_seed(3)
    tokens, k = 13, 2
    h = torch.randn(tokens, m.gate_up_proj.shape[-1] if m.is_transposed else m.gate_up_proj.shape[-1], generator=gen)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    idx[:5, 0] = 0  # expert 0 popular, and some expert possibly unused: empty groups in the grouped GEMM
    w = torch.rand(tokens, k, generator=gen)
    h1 = h.clone().requires_grad_()
    ref = m(h1, idx, w)  # transformers' own implementation
    ref_grads = torch.autograd.grad((ref * ref).sum(), [h1, *m.parameters()])
    m._llmctl_ep = ExpertGroup(group, 1, 0, None)
    m.forward = types.MethodType(dispatch_forward, m)
    h2 = h.clone().requires_grad_()
    got = m(h2, idx, w)
    grads = torch.autograd.grad((got * got).sum(), [h2, *m.parameters()])
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-4)
    assert m._llmctl_load.tolist() == torch.bincount(idx.reshape(-1), minlength=e).tolist()


def test_grad_scaled_scales_only_the_gradient() -> None:
    x = torch.randn(3, requires_grad=True)
    y = _grad_scaled(x, 0.25)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 0.25))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_rank_that_receives_no_rows_stays_in_the_graph(group, family: str) -> None:
    """A rank whose experts got no rows (a collapsed router sends every token elsewhere) must still reach the
    dispatch's all-to-all in backward, which its peers wait in: the graph from the experts' output back to the
    tokens is not cut (measured: examples/moe-cpu.yaml hung at step 6 in backward when it was)."""
    m = _experts(family)
    m._llmctl_ep = ExpertGroup(group, 1, 0, None)
    m.forward = types.MethodType(dispatch_forward, m)
    h = torch.randn(0, m.gate_up_proj.shape[-1], requires_grad=True)
    out = m(h, torch.zeros(0, 2, dtype=torch.long), torch.rand(0, 2))
    assert out.shape == (0, h.shape[1])
    (grad,) = torch.autograd.grad(out.sum(), [h])  # raises if the rows' path was cut
    assert grad.shape == h.shape
