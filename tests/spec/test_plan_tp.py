"""parallel.tp in the plan file: read into the setup's degrees (a tp group shares a micro-batch), written back by
`with_setup`, and refused in one line where the world, the model or the loss cannot be split."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from llmctl.errors import LlmctlError
from llmctl.spec.planfile import plan_from_dict
from llmctl.spec.setup import TrainSetup


def plan(preset: str = "llama-tiny", tp: int = 2, ranks: int = 8, **training: Any) -> dict[str, Any]:
    return {
        "model": {"preset": preset},
        "hardware": {"nodes": 1, "nproc_per_node": ranks},
        "parallel": {"sharding": "full_shard", "tp": tp},
        "training": {"micro_batch_size": 2, "seq_len": 128, "max_steps": 10, **training},
    }


def test_tp_is_read_into_the_degrees_and_written_back() -> None:
    p = plan_from_dict(plan(tp=2))
    s = p.setup
    assert (s.tp, s.dims.dp_shard, s.dims.dp) == (2, 4, 4)
    assert p.tokens_per_step == 2 * 128 * 4  # micro-batch per data-parallel rank: the tp pair shares one
    assert p.parallel_dims.mesh_dims == ((4, 2), ("shard", "tp"))
    back = p.with_setup(replace(s, tp=4))
    assert back.parallel.tp == 4 and back.setup.dims.dp == 2
    assert plan_from_dict(plan(tp=1)).parallel_dims.mesh_dims == ((8,), ("shard",))


def test_hybrid_shard_groups_count_data_parallel_ranks() -> None:
    p = plan_from_dict(
        {**plan(tp=2), "hardware": {"nodes": 2, "nproc_per_node": 8}, "parallel": {"sharding": "hybrid_shard", "tp": 2}}
    )
    assert p.parallel_dims.mesh_dims == ((2, 4, 2), ("replicate", "shard", "tp"))


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (plan(tp=3), "parallel.tp: 8 GPUs cannot be split into tp=3 x pp=1 groups"),
        (plan(tp=8), "tp 8 does not divide llama's num_key_value_heads 4"),
        (plan("gpt2", tp=2), "gpt2 cannot use tensor parallelism"),
        (plan(tp=2, loss_chunk_tokens=256), "tensor parallelism computes the loss on vocabulary shards"),
        (plan(tp=4, seq_len=130), "seq len 130 is not divisible by tp 4"),
    ],
    ids=["world", "kv-heads", "no-plan", "chunked-loss", "seq-len"],
)
def test_what_cannot_be_split_is_one_line(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(LlmctlError) as e:
        plan_from_dict(data)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_async_tp_needs_tp_and_compile() -> None:
    with pytest.raises(LlmctlError, match="async TP needs tp > 1 and compile"):
        TrainSetup(tp=1, async_tp=True, compile=True)
    with pytest.raises(LlmctlError, match="async TP needs"):
        TrainSetup(tp=2, gpus_per_node=2, async_tp=True)
    assert TrainSetup(tp=2, gpus_per_node=2, async_tp=True, compile=True).async_tp
