"""What llmctl's engine runs under pipeline parallelism, refused in one line each (llmctl.spec.rules): torch's limits
on a schedule run's micro-batches (torch.distributed.pipelining.schedules, torch 2.13), and the models a stage cannot
be cut from. Torch-free."""

from __future__ import annotations

import re

import pytest

from llmctl.families import REGISTRY
from llmctl.spec.models import from_hf_config
from llmctl.spec.rules import engine_problem, model_problem
from llmctl.spec.setup import TrainSetup


def setup(**kw: object) -> TrainSetup:
    return TrainSetup(**{"nodes": 1, "gpus_per_node": 8, "pp": 2, "grad_accum_steps": 8, **kw})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        # Schedule1F1B: "Number of microbatches (1) must be greater than or equal to the number of stages (2)"
        ({"pp_schedule": "1f1b", "grad_accum_steps": 1}, "1f1b needs at least pp 2 micro-batches per run, not 1"),
        # ScheduleInterleaved1F1B: rounds = max(1, m // pp) must divide m
        ({"pp_schedule": "interleaved-1f1b", "pp": 4, "grad_accum_steps": 14}, "14 micro-batches in 3 rounds of pp 4"),
        ({"pp_schedule": "interleaved-1f1b", "grad_accum_steps": 9}, "9 micro-batches in 4 rounds of pp 2"),
    ],
)
def test_engine_refuses_in_one_line(kw: dict, match: str) -> None:
    err = engine_problem(setup(**kw))
    assert err is not None and "\n" not in str(err)
    assert re.search(match, str(err)), str(err)


@pytest.mark.parametrize(
    "kw",
    [
        {"pp_schedule": "1f1b", "grad_accum_steps": 2},
        {"pp_schedule": "gpipe", "grad_accum_steps": 1},
        {"pp_schedule": "zbv", "grad_accum_steps": 1},
        {"pp_schedule": "interleaved-1f1b", "grad_accum_steps": 3},  # one round of 3
        {"pp_schedule": "interleaved-1f1b", "grad_accum_steps": 8, "precision": "bf16-mixed"},
        {"strategy": "hybrid_shard", "shard_size": 2},
        {"cp": 2},
        {"tp": 2},
        {"precision": "fp16-mixed"},  # the loss scale multiplies the last stage's loss; the norm is over all stages
    ],
)
def test_engine_runs(kw: dict) -> None:
    assert engine_problem(setup(**kw)) is None


def _spec(model_type: str, **over: object):  # noqa: ANN202
    return from_hf_config({**REGISTRY[model_type].tiny, "num_hidden_layers": 4, **over}, name=model_type)


def test_models_a_stage_cannot_be_cut_from() -> None:
    s = setup()
    assert model_problem(s, _spec("llama")) is None
    assert model_problem(s, _spec("qwen3", tie_word_embeddings=False)) is None
    tied = model_problem(s, _spec("llama", tie_word_embeddings=True))
    assert tied is not None and "ties its embedding and LM head" in str(tied)
    gemma = model_problem(s, _spec("gemma3_text", tie_word_embeddings=False))
    assert gemma is not None and "scales the embeddings" in str(gemma)
    gpt2 = model_problem(s, _spec("gpt2", tie_word_embeddings=False, n_layer=4))
    assert gpt2 is not None and "learned positions" in str(gpt2)
    assert model_problem(setup(pp=1), _spec("llama", tie_word_embeddings=True)) is None
