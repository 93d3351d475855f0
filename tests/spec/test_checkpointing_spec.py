"""The one spelling of activation-checkpointing modes, in the library and in the plan file."""

from __future__ import annotations

import pytest

from llmctl.errors import LlmctlError, SpecError
from llmctl.spec import checkpointing as ck
from llmctl.spec import planfile as pf


@pytest.mark.parametrize(
    "text,canonical",
    [
        ("none", "none"),
        ("Selective", "selective"),
        (" full ", "full"),
        ("partial:2", "partial:2"),
        ("PARTIAL:16", "partial:16"),
    ],
)
def test_spellings(text, canonical) -> None:
    assert ck.parse(text) == canonical


@pytest.mark.parametrize(
    "text,needle",
    [
        ("op", "unknown checkpointing 'op'"),
        ("partial", "unknown checkpointing"),
        ("partial:1", "write full"),
        ("partial:0", "2 <= K <= 1000"),
        ("partial:1001", "2 <= K <= 1000"),
        ("partial:-2", "unknown checkpointing"),
        ("partial:2.5", "unknown checkpointing"),
        ("", "unknown checkpointing"),
    ],
)
def test_bad_spellings_are_one_line(text, needle) -> None:
    with pytest.raises(LlmctlError, match=None) as e:
        ck.parse(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_whole_layers_follow_torchtitans_counting() -> None:
    """partial:K checkpoints layers K, 2K, ... counted from 1 (torchtitan's selective_ac_option K)."""
    assert ck.whole_layers("partial:2", 5) == (1, 3)
    assert ck.whole_layers("partial:3", 7) == (2, 5)
    assert ck.whole_layers("partial:9", 4) == ()
    assert ck.whole_layers("full", 3) == (0, 1, 2)
    assert ck.whole_layers("selective", 3) == ck.whole_layers("none", 3) == ()
    assert ck.label("partial:4") == "checkpointing 1 in 4 layers" and ck.label("none") == "no checkpointing"


def _plan(training: dict) -> dict:
    return {
        "name": "t",
        "model": {"preset": "llama-tiny"},
        "data": {"kind": "synthetic"},
        "training": {"max_steps": 1, **training},
    }


def test_plan_file_reads_every_mode_and_the_loss_chunk() -> None:
    for mode in ("none", "selective", "partial:3", "full"):
        plan = pf.plan_from_dict(_plan({"activation_checkpointing": mode, "loss_chunk_tokens": 256}))
        assert plan.training.activation_checkpointing == mode and plan.training.loss_chunk_tokens == 256
    assert pf.plan_from_dict(_plan({})).training.loss_chunk_tokens == 0


@pytest.mark.parametrize(
    "training,needle",
    [
        ({"activation_checkpointing": "partial:1"}, "training.activation_checkpointing"),
        ({"activation_checkpointing": "sometimes"}, "training.activation_checkpointing"),
        ({"activation_checkpointing": 2}, "training.activation_checkpointing"),
        ({"activation_checkpointing": True}, "training.activation_checkpointing"),
        ({"loss_chunk_tokens": -1}, "training.loss_chunk_tokens"),
        ({"loss_chunk_tokens": 1.5}, "training.loss_chunk_tokens"),
        ({"loss_chunk_tokens": True}, "training.loss_chunk_tokens"),
    ],
)
def test_plan_file_refuses_bad_modes_in_one_line(training, needle) -> None:
    with pytest.raises(SpecError) as e:
        pf.plan_from_dict(_plan(training))
    assert needle in str(e.value) and "\n" not in str(e.value)
