"""The planner's alternatives (`PlanResult.variants`) against a brute force over every checkpointing mode and loss
chunk at its largest fitting micro-batch.

The planner searches each family's options cheapest recompute first and skips an option that fits a smaller
micro-batch than a cheaper one (it is slower at every micro-batch), stopping once one fits the whole per-rank batch;
an option that fits the same micro-batch as a cheaper one is still timed (recompute priced at micro-batch 1 without
compile can order two options unlike the timed step). A mutant that also skipped the equal ones left the chosen setup
unchanged over 512 requests but dropped 26 of 44 alternatives: only a check of the whole list catches it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.plan import memory as mem
from llmctl.plan import planner as pl
from llmctl.plan import space
from llmctl.plan.ranking import recompute_seconds
from llmctl.plan.search import divisors
from llmctl.spec.models import resolve_model
from tests.plan.test_planner import H100, seed_request


def largest_fitting(req, strategy: str, nodes: int, per_rank: int, ckpt: str, attn: str, chunk: int) -> int:
    """Brute force: the largest divisor of the per-rank batch whose setup (its own accumulation) fits."""
    fit = [
        d
        for d in divisors(per_rank)
        if mem.estimate(
            req.spec,
            req.candidate(
                strategy=strategy,
                nodes=nodes,
                micro_batch_size=d,
                grad_accum_steps=per_rank // d,
                checkpointing=ckpt,
                attention=attn,
                loss_chunk_tokens=chunk,
            ),
        ).device_bytes
        <= req.capacity_bytes
    ]
    return max(fit, default=0)


def expected_options(req, strategy: str, nodes: int, attn: str, options: list[tuple[str, int]]) -> dict:
    """(checkpointing, chunk) -> micro-batch of every option the search must time: cheapest recompute first, each
    fitting at least the micro-batch of every cheaper one, none past the first that fits the whole per-rank batch."""
    per_rank = req.global_batch // (nodes * req.gpus_per_node)
    ordered = sorted(
        options,
        key=lambda o: recompute_seconds(
            req,
            req.candidate(checkpointing=o[0], attention=attn, loss_chunk_tokens=o[1]),
        ),
    )
    out, largest = {}, 0
    for ckpt, chunk in ordered:
        if largest >= per_rank:
            break
        mb = largest_fitting(req, strategy, nodes, per_rank, ckpt, attn, chunk)
        if mb == 0 or mb < largest:
            continue
        out[(ckpt, chunk)] = largest = mb
    return out


@pytest.mark.parametrize(
    "case",
    [
        # the seed: 2 x 4 A100, seq 1024, 128 sequences: every strategy fits something
        dict(),
        # one node of 8 H100 at 8k tokens: memory decides between the modes
        dict(gpu=H100, nodes=1, gpus_per_node=8, seq_len=8192, global_batch_seqs=64),
        # Llama-3.2-1B on one H100, 9 sequences of 2,048: micro-batch 9 fits only as the whole batch (no gradient
        # before the backward); with accumulation the largest divisor that fits is 3
        dict(spec=resolve_model("llama-3.2-1b"), gpu=H100, nodes=1, gpus_per_node=1, seq_len=2048, global_batch_seqs=9),
    ],
    ids=["seed", "h100-8k", "1b-one-h100"],
)
def test_the_variants_are_every_option_the_brute_force_keeps(case: dict) -> None:
    req = seed_request(attention="flash", compile=False, **case)
    result = pl.plan(req)
    chunks = sorted({0, *space.loss_chunks(req, [])})  # the loss variants the planner tries
    options = [(m, c) for m in space.checkpointing_modes(req.spec) for c in chunks]
    families = {(c.setup.strategy, c.setup.nodes) for c in result.variants}
    assert families
    for strategy, nodes in sorted(families):
        got = {
            (c.setup.checkpointing, c.setup.loss_chunk_tokens): c.setup.micro_batch_size
            for c in result.variants
            if (c.setup.strategy, c.setup.nodes) == (strategy, nodes)
        }
        want = expected_options(req, strategy, nodes, "flash", options)
        assert got == want, (strategy, nodes)
    assert len(result.variants) >= 2


def test_the_brute_force_sees_equal_micro_batches() -> None:
    """The case that kills the `<=` mutant exists: two options of one family fit the same micro-batch."""
    req = seed_request(attention="flash", compile=False, gpu=H100, nodes=1, gpus_per_node=8, seq_len=8192)
    result = pl.plan(req)
    by_family: dict[tuple, list[int]] = {}
    for c in result.variants:
        by_family.setdefault((c.setup.strategy, c.setup.nodes), []).append(c.setup.micro_batch_size)
    assert any(len(mbs) != len(set(mbs)) for mbs in by_family.values()), by_family


def test_the_whole_batch_is_tried_without_accumulation() -> None:
    """One micro-batch a step holds no gradient in its forward: Llama-3.2-1B on one H100 fits micro-batch 9 only so."""
    spec = resolve_model("llama-3.2-1b")
    req = seed_request(spec=spec, gpu=H100, nodes=1, gpus_per_node=1, seq_len=2048, global_batch_seqs=9)
    # to the last byte: micro-batch 9 fits within a few GiB of the whole GPU, inside the default margin
    req = replace(req, memory_margin=0.0).with_pins(attention="flash", compile=False, checkpointing="none")
    assert largest_fitting(req, "full_shard", 1, 9, "none", "flash", 0) == 9
    accumulating = req.candidate(
        micro_batch_size=9, grad_accum_steps=2, attention="flash"
    )  # as if a second micro-batch came
    assert mem.estimate(spec, accumulating).device_bytes > req.capacity_bytes
    chosen = pl.plan(req).chosen.setup
    assert (chosen.micro_batch_size, chosen.grad_accum_steps) == (9, 1)
