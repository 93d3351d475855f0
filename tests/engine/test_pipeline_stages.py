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


def test_the_last_stages_loss_per_micro_batch() -> None:
    """StageLoss, call by call: the schedule's metadata inference (outside `counted`) records nothing; a counted call
    records the micro-batch's mean loss over the real vocabulary and returns it times multiplier / grad_accum_steps
    (the data-parallel path's scaling, the schedule's own off); packed data's summed loss is scaled by each
    micro-batch's divisor in turn (recorded: sum x acc / divisor; returned: sum x multiplier / divisor); evaluation
    records and returns the sum."""
    import torch.nn.functional as F

    from llmctl.engine.pipeline import StageLoss

    vocab, padded = 10, 16
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, padded, generator=gen)
    targets = torch.randint(0, vocab, (2, 4), generator=gen)
    targets[0, 0] = -100
    flat = logits[..., :vocab].reshape(-1, vocab), targets.reshape(-1)
    mean, total = F.cross_entropy(*flat), F.cross_entropy(*flat, reduction="sum")

    loss = StageLoss(vocab, grad_accum_steps=4, multiplier=2.0)
    counted = loss.counted(loss)
    assert float(loss(logits, targets)) == 0.0 and loss.recorded == []  # metadata inference
    got = counted(logits, targets)
    assert torch.allclose(loss.recorded[0], mean) and torch.allclose(got, mean * 2.0 / 4)
    assert not loss.counting

    loss.divisors, loss.recorded = [10.0, 20.0], []
    first, second = counted(logits, targets), counted(logits, targets)
    assert torch.allclose(torch.stack(loss.recorded), torch.stack([total * 4 / 10, total * 4 / 20]))
    assert torch.allclose(first, total * 2.0 / 10) and torch.allclose(second, total * 2.0 / 20)

    loss.evaluating, loss.divisors, loss.recorded = True, [], []
    assert torch.allclose(counted(logits, targets), total) and torch.allclose(loss.recorded[0], total)


def _pipeline(stage_ids: list[int], num_stages: int, group: object = None):  # -> Pipeline
    from llmctl.engine.pipeline import Pipeline, StageLoss

    return Pipeline([], stage_ids, num_stages, None, StageLoss(16, 1), group, 2)


def test_the_gradient_norm_is_summed_over_the_pp_group_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """total_norm: this rank's stages' norm squared, all-reduced over the pipeline's process group (not the world: the
    norm is whole over the data-parallel ranks already), then the root. The other stage's norm is 4: 3 and 4 make 5."""
    import torch.distributed as dist

    seen: list[tuple[float, object]] = []

    def all_reduce(t: torch.Tensor, group: object = None) -> None:
        seen.append((float(t), group))
        t += 16.0  # the other stage's squared norm

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    pp_group = object()
    got = _pipeline([0], 2, pp_group).total_norm(torch.tensor(3.0))
    assert seen == [(9.0, pp_group)] and float(got) == 5.0 and got.shape == ()


def test_each_stage_gets_the_inputs_it_runs() -> None:
    """The schedule's inputs per rank: the token ids to the rank with stage 0, the targets to the rank with the last
    stage (ZB-V's rank 0 holds stages 0 and 3 of 4: both), the positions to every stage."""
    from llmctl.engine.data import Batch

    ids, pos = torch.arange(8).view(2, 4), torch.arange(4).expand(2, 4)
    b = Batch(ids, ids + 1, pos)
    cases = {(0, 3): (True, True), (1, 2): (False, False), (0,): (True, False), (1,): (False, True)}
    for stage_ids, (first, last) in cases.items():
        p = _pipeline(list(stage_ids), 4 if len(stage_ids) == 2 else 2)
        args, kwargs = p._feed(b)
        assert (p.has_first, p.has_last) == (first, last), stage_ids
        assert len(args) == first and (not first or args[0] is ids), stage_ids
        assert ("target" in kwargs) is last and kwargs["position_ids"] is pos, stage_ids


def test_evaluation_counts_the_loss_tokens_it_summed_over() -> None:
    """evaluate: the schedule's summed loss per micro-batch (as StageLoss records it) and the tokens the loss was
    summed over: the targets it ignores (padding, prompts) not counted, or the mean eval loss comes out too low. A
    rank without the last stage records nothing: (0, 0)."""
    from llmctl.engine.data import IGNORE, Batch

    class Schedule:
        def __init__(self, loss, records: bool) -> None:
            self.loss, self.records, self.targets = loss, records, None

        def eval(self, *args, **kwargs) -> None:
            self.targets = kwargs.get("target")
            if self.records:
                self.loss.recorded += [torch.tensor(1.5), torch.tensor(2.0)]

    ids = torch.arange(8).view(2, 4)
    targets = torch.tensor([[1, 2, IGNORE, IGNORE], [IGNORE, 5, 6, 7]])
    batches = [Batch(ids[:1], targets[:1], None), Batch(ids[1:], targets[1:], None)]
    for stage_ids, want in (([1], (3.5, 5)), ([0], (0.0, 0))):
        p = _pipeline(stage_ids, 2)
        p.schedule = Schedule(p.loss, records=p.has_last)
        loss, tokens = p.evaluate(batches, torch.device("cpu"))
        assert p.loss.evaluating and (float(loss), tokens) == want and loss.dtype == torch.float64, stage_ids
        assert (p.schedule.targets is not None) is p.has_last
