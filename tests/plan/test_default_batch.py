"""The default global batch in tokens by model size (llmctl.plan.batch: GPT-3's Table 2.1, Llama 3's 405B): long
sequences get fewer sequences a step, rounded up to a multiple of the data-parallel ranks; the pins win."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.plan import batch
from llmctl.plan import comm as cm
from llmctl.plan.request import build_request
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from tests.plan.requests import plan_request

H100 = resolve_gpu("H100")
NET = cm.Network(intra_gbytes_s=360.0, inter_node_gbytes_s=400.0)
L8B = resolve_model("llama-3.1-8b")


def request(spec=L8B, nodes: int = 1, **kw):
    args = dict(spec=spec, gpu=H100, nodes=nodes, gpus_per_node=8, network=NET, seq_len=2048)
    args.update(kw)
    return plan_request(**args)


@pytest.mark.parametrize(
    ("params", "m_tokens", "row_params"),
    [
        (124_439_808, 0.5, 125_000_000),  # GPT-2 small, below GPT-3 Small: its row
        (1_235_814_400, 0.5, 760_000_000),  # llama-3.2-1b: GPT-3 Large's
        (1_300_000_000, 1, 1_300_000_000),  # a row's own size takes it
        (6_699_999_999, 1, 2_700_000_000),
        (6_700_000_000, 2, 6_700_000_000),
        (70_553_706_496, 2, 13_000_000_000),
        (235_000_000_000, 3.2, 175_000_000_000),
        (405_853_388_800, 4, 405_000_000_000),  # Llama 3's initial batch
    ],
)
def test_the_row_is_the_largest_published_model_no_bigger(params, m_tokens, row_params) -> None:
    row = batch.default_row(params)
    assert (row.m_tokens, row.params) == (m_tokens, row_params)


def test_the_sources_m_is_binary() -> None:
    """GPT-3's 0.5M at 2,048 tokens is 256 sequences; Llama 3's 4M at 4,096 is 1,024."""
    assert batch.default_global_batch(125_000_000, 2048, 1) == 256
    assert batch.default_global_batch(405_000_000_000, 4096, 8) == 1024


def test_128k_on_llama_8b_gets_2m_tokens_not_128_sequences() -> None:
    """Issue 48: at 128k tokens the default was 128 sequences, 16.7M tokens; now GPT-3 6.7B's 2M tokens: 16."""
    req = request(seq_len=131072)
    assert req.global_batch == 16 and req.global_batch * req.seq_len == 2**21
    # 8 nodes: 16 sequences do not split over 64 GPUs; with cp 8 pinned they split over its 8 data-parallel ranks
    assert request(nodes=8, seq_len=131072).global_batch == 64
    assert request(nodes=8, seq_len=131072, cp=8).global_batch == 16
    assert request(nodes=8, seq_len=131072, cp=4, tp=4).global_batch == 16
    assert request(nodes=8, seq_len=131072, cp=4).global_batch == 16  # 16 data-parallel ranks
    # a length that does not divide the tokens: rounded up, then to a multiple of the 8 GPUs
    assert request(seq_len=3000).global_batch == 704  # 2,097,152 / 3,000 = 699.05 -> 700 -> 704


def test_a_small_model_at_2k_gets_its_row() -> None:
    spec = resolve_model("llama-3.2-1b")  # 1.24B: GPT-3 Large's 0.5M tokens
    assert request(spec).global_batch == 256
    assert request(spec, gpus_per_node=1).global_batch == 256
    assert request(spec, nodes=64).global_batch == 512  # one sequence per GPU at least


def test_a_cpu_plan_and_fine_tuning_take_their_own_defaults() -> None:
    """The table is pre-training's: on a CPU it would be 4,096 sequences of 128 tokens a step (llama-tiny), with
    adapters 1,024 of 2,048 for an 8B; a CPU plan takes the shipped examples' 16, adapters llmctl's earlier 128."""
    from llmctl.spec.finetune import Finetune

    cpu = request(resolve_model("llama-tiny"), gpu=resolve_gpu("cpu"), gpus_per_node=2, seq_len=128)
    assert cpu.batch_kind == "cpu" and cpu.global_batch == batch.CPU_BATCH_SEQS == 16
    assert "the shipped CPU examples' 16 sequences" in cpu.batch_line()
    assert (
        request(resolve_model("llama-tiny"), gpu=resolve_gpu("cpu"), gpus_per_node=32, seq_len=128).global_batch == 32
    )
    lora = request(finetune=Finetune("lora"))
    assert lora.batch_kind == "finetune" and lora.global_batch == 128
    assert "the default with adapters, 128 sequences" in lora.batch_line()
    assert request().batch_kind == "pretrain" and request().global_batch == 1024


def test_the_pins_win() -> None:
    assert request(seq_len=131072, global_batch_seqs=128).global_batch == 128
    opts = dict(
        params=None,
        gpu="H100",
        gpus=8,
        nodes=None,
        gpus_per_node=None,
        cluster=None,
        net=None,
        intra_gbps=None,
        inter_gbps=None,
        global_batch=None,
        global_batch_tokens=None,
        tokens=None,
        price=None,
        objective="throughput",
        overlap=cm.DEFAULT_OVERLAP,
        calibrate=None,
    )
    seq = {"seq_len": 131072}
    assert build_request("llama-3.1-8b", opts, seq)[0].global_batch == 16
    assert build_request("llama-3.1-8b", opts | {"global_batch": 40}, seq)[0].global_batch == 40
    tokens = opts | {"global_batch_tokens": 8 * 131072}
    req = build_request("llama-3.1-8b", tokens, seq)[0]
    assert req.global_batch == 8
    assert "as asked (--global-batch or --global-batch-tokens)" in req.batch_line()
    assert "GPT-3" not in req.batch_line()


def test_the_line_says_the_source_the_rounding_and_the_step() -> None:
    line = request(nodes=8, seq_len=131072).batch_line(step_time_s=12.345)
    assert line.startswith("64 sequences of 131,072 tokens (8.39M tokens) a step, 12.3 s on the chosen setup: ")
    assert "the default at 8.03B parameters, 2M tokens, the batch of the 6.7B model in GPT-3's Table 2.1" in line
    assert "(16 sequences, rounded up to a multiple of the 64 data-parallel ranks)" in line
    exact = request(seq_len=131072).batch_line()
    assert "rounded" not in exact and exact.startswith("16 sequences of 131,072 tokens (2.1M tokens) a step: ")
    big = request(resolve_model("llama-3.1-405b"), seq_len=8192).batch_line()
    assert "4M tokens, the batch of the 405B model in Llama 3's section 3.4.1 (Grattafiori et al. 2024" in big


def test_plan_at_128k_says_the_batch_and_its_step(tmp_path) -> None:
    """`llmctl plan llama-3.1-8b --gpu H100 --gpus 8 --seq-len 131072`: 16 sequences, the source and the step time."""
    args = ["plan", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--seq-len", "131072", "--no-write"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["global_batch_seqs"] == 16
    c = data["chosen"]
    assert c["micro_batch"] * c["grad_accum"] * c["gpus"] // (c["tp"] * c["cp"] * c.get("pp", 1)) == 16
    step = c["step_time_s"]
    assert data["global_batch_why"].startswith(f"16 sequences of 131,072 tokens (2.1M tokens) a step, {step:.3g} s ")
    r = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert "global batch 16 sequences (2,097,152 tokens)" in r.output
    assert f"global batch: 16 sequences of 131,072 tokens (2.1M tokens) a step, {step:.3g} s on the chosen" in r.output
