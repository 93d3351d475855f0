"""The one training setup: the plan file reads and writes it (a round trip loses nothing), its degrees come from the
layout once, and the precision policy is the one place a precision's dtypes are decided."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmctl.errors import InputError, LlmctlError
from llmctl.plan import comm as cm
from llmctl.plan import memory as mem
from llmctl.plan.timing import evaluate
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from llmctl.spec.planfile import plan_from_dict, plan_to_yaml
from llmctl.spec.precision import ENGINE_PRECISIONS, POLICIES, policy
from llmctl.spec.setup import TrainSetup
from tests.plan.requests import plan_request

PLAN = {
    "name": "t",
    "model": {"preset": "llama-tiny"},
    "hardware": {"gpu": "A100-80GB", "nodes": 2, "nproc_per_node": 4},
    "parallel": {"sharding": "hybrid_shard", "shard_size": 2},
    "training": {
        "precision": "bf16",
        "micro_batch_size": 3,
        "grad_accum_steps": 5,
        "seq_len": 96,
        "activation_checkpointing": "partial:3",
        "loss_chunk_tokens": 64,
        "attention": "auto",
        "compile": True,
        "max_steps": 7,
    },
}


def test_the_plan_file_reads_every_field_of_its_setup() -> None:
    s = plan_from_dict(PLAN).setup
    assert (s.strategy, s.nodes, s.gpus_per_node, s.shard_size) == ("hybrid_shard", 2, 4, 2)
    assert (s.dims.dp_replicate, s.dims.dp_shard, s.dims.tp) == (4, 2, 1)
    assert s.precision is POLICIES["bf16"]
    assert (s.micro_batch_size, s.grad_accum_steps, s.seq_len) == (3, 5, 96)
    assert (s.checkpointing, s.loss_chunk_tokens, s.attention, s.compile) == ("partial:3", 64, "auto", True)
    assert s.tokens_per_step == 3 * 5 * 96 * 8


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"parallel": {"sharding": "hybrid_shard", "shard_size": None}},
        {"parallel": {"sharding": "hybrid_shard", "shard_size": 4}},  # spelled out though it is the default
        {"parallel": {"sharding": "no_shard"}},
        {"hardware": {"gpu": None, "nodes": 1, "nproc_per_node": 2}, "parallel": {"sharding": "full_shard"}},
    ],
)
def test_with_its_own_setup_a_plan_is_written_back_byte_for_byte(over: dict) -> None:
    data = {**PLAN, **over}
    plan = plan_from_dict(data)
    assert plan_to_yaml(plan.with_setup(plan.setup)) == plan_to_yaml(plan)


def test_with_setup_writes_each_decision_and_keeps_the_rest() -> None:
    plan = plan_from_dict(PLAN)
    new = replace(
        plan.setup,
        strategy="full_shard",
        shard_size=None,
        micro_batch_size=5,
        grad_accum_steps=3,
        checkpointing="selective",
        compile=False,
        loss_chunk_tokens=0,
        attention="sdpa",
        precision="fp32",
    )
    out = plan.with_setup(new)
    assert out.setup == new
    t = out.training
    assert (t.micro_batch_size, t.grad_accum_steps, t.activation_checkpointing, t.compile) == (5, 3, "selective", False)
    assert (t.precision, t.attention, t.loss_chunk_tokens) == ("fp32", "sdpa", 0)
    assert (out.parallel.sharding, out.parallel.shard_size) == ("full_shard", None)
    assert (out.model, out.optimizer, out.data, out.name, t.max_steps) == (
        plan.model,
        plan.optimizer,
        plan.data,
        plan.name,
        7,
    )


def test_a_setup_the_plan_file_refuses_is_one_line_naming_the_key() -> None:
    plan = plan_from_dict(PLAN)
    with pytest.raises(LlmctlError, match=r"^the trial: training.micro_batch_size: Input should be less than"):
        plan.with_setup(replace(plan.setup, micro_batch_size=10**9), "the trial")


def test_setup_validation_is_one_line() -> None:
    with pytest.raises(InputError, match="hybrid_shard needs at least 2 nodes"):
        TrainSetup(strategy="hybrid_shard", gpus_per_node=8)
    TrainSetup(strategy="hybrid_shard", gpus_per_node=8, shard_size=4)  # a shard size makes one node a 2 x 4 mesh
    with pytest.raises(InputError, match="unknown precision 'fp4'"):
        TrainSetup(precision="fp4")
    assert TrainSetup(ep=2, gpus_per_node=2).dims.expert_shard == 1  # ep borrows both data-parallel ranks
    with pytest.raises(InputError, match="ep 4 must divide the ranks it borrows from: dp_shard 2 x cp 1 = 2"):
        TrainSetup(ep=4, gpus_per_node=2)
    with pytest.raises(InputError, match="ep 2 must divide .* dp_shard 1"):  # no_shard: one shard rank per replica
        TrainSetup(ep=2, gpus_per_node=2, strategy="no_shard")
    with pytest.raises(InputError, match=r"seq len 100 is not divisible by 8 \(4 chunks for cp 2 \(head-tail"):
        TrainSetup(cp=2, tp=2, gpus_per_node=4, seq_len=100)
    TrainSetup(cp=2, gpus_per_node=2, seq_len=102, cp_load_balance=False)  # 2 chunks without the load balance
    with pytest.raises(InputError, match="ring attention on SDPA, not flash"):
        TrainSetup(cp=2, gpus_per_node=2, attention="flash")
    with pytest.raises(InputError, match="unknown cp rotate method 'ring'"):
        TrainSetup(cp=2, gpus_per_node=2, cp_rotate="ring")
    with pytest.raises(InputError, match="needs the attention kernel"):
        mem.estimate(resolve_model("llama-tiny"), TrainSetup(attention="auto"))


def test_auto_attention_is_the_kernel_the_engine_runs() -> None:
    tiny, a100, v100 = resolve_model("llama-tiny"), resolve_gpu("A100-80GB"), resolve_gpu("V100-32GB")
    assert TrainSetup(attention="auto").kernel(a100, tiny) == "flash"
    assert TrainSetup(attention="auto", precision="fp32").kernel(a100, tiny) == "sdpa"
    assert TrainSetup(attention="auto", precision="fp16-mixed").kernel(v100, tiny) == "sdpa"  # no flash-attn 2 there
    assert TrainSetup(attention="auto").kernel(None, tiny) == "sdpa"  # a CPU run


# --- precision policies ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "engine", "bytes_per_param", "zero_bytes", "reduce_bytes"),
    [
        ("fp32", "fsdp2", 16, 16, 4),
        ("bf16", "fsdp2", 8, 8, 2),
        ("bf16-mixed", "fsdp2", 16, 18, 4),
        ("fp16-mixed", "zero", 16, 18, 4),
    ],
)
def test_each_policy_gives_the_ledger_and_the_reduce_bytes(name, engine, bytes_per_param, zero_bytes, reduce_bytes):
    """The persistent bytes per parameter of AdamW training (fsdp2 keeps no half copy; ZeRO's ledger has the classic
    18 for mixed precision) and the bytes a gradient reduce moves per element, all from the policy."""
    spec = resolve_model("llama-2-7b")
    s = TrainSetup(precision=name, engine="fsdp2" if name != "fp16-mixed" else engine)
    ledger = mem.state_ledger(spec, replace(s, engine="fsdp2"))
    assert sum(line.bytes_per_param for line in ledger) == bytes_per_param
    assert mem.classic_bytes_per_param(spec, s) == zero_bytes
    assert s.precision.reduce_bytes == reduce_bytes
    assert s.compute_bytes == (4 if name == "fp32" else 2)


def test_the_cost_model_moves_gradients_in_the_reduce_dtype() -> None:
    """Pure bf16 reduces bf16 gradients, bf16-mixed fp32 ones: on a communication-bound setup (no_shard over two
    nodes on a slow link: one all-reduce of every gradient per step) the comm time halves."""
    spec, a100 = resolve_model("llama-2-7b"), resolve_gpu("A100-80GB")
    net = cm.Network(240.0, 1.0)

    def comm_s(precision: str) -> float:
        req = plan_request(
            spec=spec, gpu=a100, nodes=2, gpus_per_node=4, network=net, seq_len=1024, precision=precision
        )
        return evaluate(
            req,
            req.candidate(strategy="no_shard", nodes=2, grad_accum_steps=16, checkpointing="full", attention="flash"),
        ).predicted.comm_total_s

    assert comm_s("bf16") == pytest.approx(comm_s("bf16-mixed") / 2, rel=0.01)


def test_every_policy_is_run_by_the_engine_and_aliases_name_one_each() -> None:
    assert set(ENGINE_PRECISIONS) == set(POLICIES)
    assert policy("FP16_mixed") is POLICIES["fp16-mixed"] is policy("fp16") is policy("16-mixed")
    assert policy("fp8") is policy("float8") is POLICIES["fp8-tensorwise"]
    assert policy("bf16") is POLICIES["bf16"] and not policy("bf16").mixed  # bf16 stays pure, as plan files say
    with pytest.raises(InputError, match="unknown precision 'fp4'.*fp16, fp8"):
        policy("fp4")
