"""Every family the pipeline runs is cut into stages (llmctl.engine.pipeline) whose chained forwards give the whole
model's logits, in one process (no schedule): the first stage from the token ids, each later one from the previous
stage's hidden states as `inputs_embeds`, the last with the norm and LM head. The stages keep the whole model's
parameter names and the same random init (drawn by name). A family whose base forward rewrites `inputs_embeds`
(or that ties its head) is refused by the pp split rule, not cut wrongly."""

from __future__ import annotations

import pytest

from llmctl.families import REGISTRY
from llmctl.spec.models import from_hf_config
from llmctl.spec.pipeline import split_layers
from llmctl.spec.rules import model_problem
from llmctl.spec.setup import TrainSetup
from tests.family_configs import tiny

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

SETUP = TrainSetup(nodes=1, gpus_per_node=2, pp=2, grad_accum_steps=2, precision="fp32", attention="auto")


def cut_families() -> list[str]:
    """The families the pp split rule lets through, their tiny config untied."""
    out = []
    for mt in REGISTRY:
        spec = from_hf_config(tiny(mt, tie_word_embeddings=False), name=mt)
        if model_problem(SETUP, spec, only=("pp split",)) is None:
            out.append(mt)
    return out


@pytest.mark.parametrize("model_type", cut_families())
def test_chained_stages_give_the_whole_models_logits(model_type: str) -> None:
    from llmctl.engine.model import Values, build_meta_model, materialize
    from llmctl.engine.pipeline import stage_module

    spec = from_hf_config(tiny(model_type, tie_word_embeddings=False), name=model_type)
    full = build_meta_model(spec, SETUP, "sdpa")  # or the kernel the class has (fit_attention)
    n = spec.num_layers
    parts = split_layers(n, 3 if n >= 2 else 2)  # 3 stages: a middle one without embedding or head
    stages = [stage_module(full, p.first_block, p.num_blocks, p.embedding, p.head) for p in parts]
    values = Values(0, spec.vocab_size)
    materialize(full, SETUP, torch.device("cpu"), values)
    names = set()
    for s in stages:
        materialize(s, SETUP, torch.device("cpu"), values)
        names |= {k for k, _ in s.named_parameters()}
    assert names == {k for k, _ in full.named_parameters()}
    for s in stages:  # each parameter drawn as the whole model's (seeded by its name)
        for k, p in s.named_parameters():
            assert torch.equal(p, full.get_parameter(k)), k
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    full.eval()
    with torch.no_grad():
        want = full(input_ids=ids).logits
        x = ids
        for s in stages:
            s.eval()
            x = s(x)
    assert x.shape == want.shape
    assert float((x - want).abs().max()) <= 1e-5
