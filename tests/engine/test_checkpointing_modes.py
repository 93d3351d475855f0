"""Selective, partial and full activation checkpointing and the chunked loss change memory, never the numbers.

fp32 on the CPU: checkpointing replays the same ops in the same order, so losses and gradients are bit-identical to
no checkpointing (asserted exactly); the chunked loss sums per-chunk losses in another order, so it is equal within
float rounding (losses within 1e-6, gradients within 1e-5, as the issue asks).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests.engine.conftest import check_ok, losses, records, run_engine_plans, write_plan

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.engine import loss as loss_mod  # noqa: E402
from llmctl.engine.parallelize import apply_activation_checkpointing  # noqa: E402

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "num_hidden_layers": 4,
    "tie_word_embeddings": False,
}
# GPT-2 with its default dropout (0.1 on embeddings, attention and residuals) and tied embeddings: the recompute
# must replay the RNG, and the chunked loss must use the tied matrix as the head.
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 3, "vocab_size": 300, "n_positions": 256}


def build(cfg: dict, attention: str = "sdpa"):
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model.train()
    return model


def step(cfg: dict, mode: str, chunk: int = 0, attention: str = "sdpa", vocab: int | None = None):
    """(loss, {name: grad}) of one forward/backward with the engine's wrappers."""
    model = build(cfg, attention)
    apply_activation_checkpointing(model, mode)
    vocab = vocab or cfg["vocab_size"]
    ids = torch.randint(0, vocab, (3, 40), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(123)  # dropout masks
    if chunk:
        loss_mod.install_loss_forward(model, "chunked", vocab, chunk)
        loss = model(input_ids=ids, labels=ids)
    else:
        loss = loss_mod.whole_loss(model, ids, ids, vocab)
    loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2-dropout-tied"])
@pytest.mark.parametrize("mode", ["selective", "partial:2", "partial:3", "full"])
def test_checkpointing_modes_are_bit_identical_to_none(cfg, mode) -> None:
    ref_loss, ref = step(cfg, "none")
    got_loss, grads = step(cfg, mode)
    assert torch.equal(got_loss, ref_loss)
    assert grads.keys() == ref.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref[name]), name


def test_selective_with_eager_attention_is_bit_identical() -> None:
    ref_loss, ref = step(LLAMA, "none", attention="eager")
    got_loss, grads = step(LLAMA, "selective", attention="eager")
    assert torch.equal(got_loss, ref_loss)
    assert all(torch.equal(g, ref[n]) for n, g in grads.items())


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2-dropout-tied"])
@pytest.mark.parametrize("chunk", [7, 32, 120, 10_000])
def test_chunked_loss_equals_the_whole_loss(cfg, chunk) -> None:
    ref_loss, ref = step(cfg, "none")
    got_loss, grads = step(cfg, "selective", chunk=chunk)
    assert float(got_loss) == pytest.approx(float(ref_loss), abs=1e-6, rel=0)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[name], atol=1e-5, rtol=0, msg=name)


def test_chunked_loss_ignores_padded_vocabulary_rows() -> None:
    """The engine pads the LM head (model.pad_vocab_multiple); the loss is over the real vocabulary only."""
    padded = {**LLAMA, "vocab_size": 320}
    ref_loss, ref = step(padded, "none", vocab=300)
    got_loss, grads = step(padded, "none", chunk=50, vocab=300)
    assert float(got_loss) == pytest.approx(float(ref_loss), abs=1e-6, rel=0)
    torch.testing.assert_close(grads["lm_head.weight"], ref["lm_head.weight"], atol=1e-5, rtol=0)
    assert torch.count_nonzero(grads["lm_head.weight"][300:]) == 0


def test_the_loss_implementation_is_chosen_by_what_the_machine_has() -> None:
    assert loss_mod.select_loss(0, True, True)[0] == "whole"
    assert loss_mod.select_loss(512, True, True)[0] == "liger"
    impl, why = loss_mod.select_loss(512, True, False)
    assert impl == "chunked" and "liger-kernel not installed" in why
    impl, why = loss_mod.select_loss(512, False, True)
    assert impl == "chunked" and "no CUDA" in why and "512 tokens" in why


def test_liger_path_passes_the_real_vocabulary_rows(monkeypatch) -> None:
    """liger-kernel runs only on CUDA; a stand-in with its call signature (weight, input, target, bias) checks what
    the engine hands it: the head's real-vocabulary rows and flattened tokens."""
    calls = []

    class FusedLinearCrossEntropy(torch.nn.Module):
        def __init__(self, reduction: str = "mean", softcap: float | None = None) -> None:
            super().__init__()
            self.reduction = reduction

        def forward(self, lin_weight, _input, target, bias=None):
            calls.append((tuple(lin_weight.shape), tuple(_input.shape), tuple(target.shape), bias))
            return torch.nn.functional.cross_entropy(_input @ lin_weight.T, target, reduction=self.reduction)

    fake = types.ModuleType("liger_kernel.transformers")
    fake.LigerFusedLinearCrossEntropyLoss = FusedLinearCrossEntropy
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    padded = {**LLAMA, "vocab_size": 320}
    model = build(padded)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = loss_mod.whole_loss(model, ids, ids, 300)
    loss_mod.install_loss_forward(model, "liger", 300, 512)
    got = model(input_ids=ids, labels=ids)
    assert calls == [((300, 64), (32, 64), (32,), None)]
    assert float(got.detach()) == pytest.approx(float(ref.detach()), abs=1e-6)
    summed = model(input_ids=ids, labels=ids, reduction="sum")  # evaluation's call
    assert float(summed.detach()) == pytest.approx(float(ref.detach()) * ids.numel(), rel=1e-6)


def test_the_installed_liger_takes_the_call_the_engine_makes() -> None:
    """The real package (extra [liger], in [dev]) imports without CUDA: its loss takes (weight, input, target, bias)
    and a soft-cap, as liger_loss calls it."""
    import inspect

    liger = pytest.importorskip(
        "liger_kernel.transformers", reason="liger-kernel not installed (pip install 'llmctl[liger]')"
    )
    cls = liger.LigerFusedLinearCrossEntropyLoss
    assert list(inspect.signature(cls.forward).parameters)[:5] == ["self", "lin_weight", "_input", "target", "bias"]
    assert {"softcap", "reduction"} <= set(inspect.signature(cls.__init__).parameters)
    assert loss_mod.liger_importable()


@pytest.mark.dist
def test_modes_on_two_gloo_ranks_give_the_same_losses(tmp_path: Path) -> None:
    """The engine end to end (its entry point, FSDP2 full shard, 2 ranks, 5 steps; the five runs in one torchrun):
    checkpointing modes give bit-identical losses and gradient norms; the chunked loss equal within 1e-6 (losses)
    and 1e-5 (gradient norms)."""
    runs = {
        "none": {},
        "selective": {"activation_checkpointing": "selective"},
        "partial:2": {"activation_checkpointing": "partial:2"},
        "full": {"activation_checkpointing": "full"},
        "chunked": {"loss_chunk_tokens": 48, "activation_checkpointing": "selective"},
    }
    plans = {
        name: write_plan(tmp_path / name.replace(":", "-"), {"training": {"max_steps": 5, **over}})
        for name, over in runs.items()
    }
    procs = run_engine_plans(list(plans.values()), 2, tmp_path)
    out = {}
    for name, over in runs.items():
        plan = plans[name]
        check_ok(procs[plan])
        start = records(plan, "start")[0]
        assert start["checkpointing"] == over.get("activation_checkpointing", "none")
        assert start["loss_mode"] == ("chunked" if "loss_chunk_tokens" in over else "whole")
        out[name] = (losses(plan), [r["grad_norm"] for r in records(plan, "step")])
    ref_loss, ref_norm = out.pop("none")
    assert sorted(ref_loss) == [1, 2, 3, 4, 5] and ref_loss[5] < ref_loss[1]
    chunked_loss, chunked_norm = out.pop("chunked")
    for name, (loss, norm) in out.items():
        assert loss == ref_loss and norm == ref_norm, name
    for s in ref_loss:
        assert chunked_loss[s] == pytest.approx(ref_loss[s], abs=1e-6, rel=0)
    assert chunked_norm == pytest.approx(ref_norm, abs=1e-5, rel=0)
