"""Expert parallelism's refusals, one line each, naming the decision: a dense model, an ep that does not split the
routed experts or the ranks it borrows, Llama 4's every-token MoE, adapters, and the engine's ep at tp 1."""

from __future__ import annotations

import pytest

from llmctl.errors import InputError
from llmctl.spec import experts
from llmctl.spec.finetune import Finetune
from llmctl.spec.models import from_preset as get_model
from llmctl.spec.rules import engine_problem, model_problem
from llmctl.spec.setup import TrainSetup


def test_ep_split_rule() -> None:
    s = TrainSetup(gpus_per_node=8, ep=8)
    assert model_problem(s, get_model("qwen3-30b-a3b")) is None  # 128 experts
    err = model_problem(s, get_model("llama-3.1-8b"))
    assert err is not None and err.rule == "ep split" and "ep" in err.decisions
    assert err.message == "expert parallelism (ep 8) needs a mixture-of-experts model; llama-3.1-8b is dense"
    err = model_problem(TrainSetup(gpus_per_node=8, ep=8), get_model("mixtral-8x7b"))
    assert err is None  # 8 experts over 8
    six = TrainSetup(gpus_per_node=6, ep=3)
    err = model_problem(six, get_model("mixtral-8x7b"))
    assert err is not None and err.message == "ep 3 does not divide mixtral-8x7b's 8 routed experts"
    assert model_problem(TrainSetup(gpus_per_node=8), get_model("llama-3.1-8b")) is None  # ep 1: nothing to say


def test_llama4_every_token_moe_refuses_ep() -> None:
    spec = get_model("llama-4-scout")
    err = model_problem(TrainSetup(gpus_per_node=8, ep=2), spec)
    assert err is not None and "every token through every expert" in err.message


def test_layout_and_engine_refusals() -> None:
    with pytest.raises(InputError, match="ep 16 must divide the ranks it borrows from: dp_shard 8 x cp 1 = 8"):
        TrainSetup(gpus_per_node=8, ep=16)
    with pytest.raises(InputError, match="lora: expert parallelism is planned for full training only"):
        TrainSetup(gpus_per_node=8, ep=2, finetune=Finetune("lora"))
    err = engine_problem(TrainSetup(gpus_per_node=8, ep=2, tp=2))
    assert err is not None and err.rule == "ep at tp 1" and "tp 2" in err.message
    err = engine_problem(TrainSetup(gpus_per_node=8, ep=2, pp=2))
    assert err is not None and "runs at pp 1" in err.message and "pp" in err.decisions
    assert engine_problem(TrainSetup(gpus_per_node=8, ep=4, cp=2)) is None  # ep over dp_shard 4 x cp 2
    assert TrainSetup(gpus_per_node=8, ep=4, cp=2).dims.expert_shard == 2


def test_expert_share_and_dispatch_rows() -> None:
    sh = experts.share(128, 8, 2)
    assert sh.local_experts == 16 and sh.first_expert(3) == 48 and sh.owner(47) == 2 and sh.owner(48) == 3
    assert sh.param_fraction == 1 / 16
    # 4096 tokens top-8 at ep 8: 32768 rows, 7/8 leave the rank; a balanced rank receives its 32768 back
    assert experts.dispatch_rows(4096, 8, 8) == (28672.0, 32768.0)
    assert experts.dispatch_rows(4096, 8, 8, imbalance=1.5) == (28672.0, 49152.0)
    assert experts.dispatch_rows(10, 2, 1) == (0.0, 20.0)
