"""Host memory per node (llmctl.plan.memory.host): every plan's line, per rank items times the node's ranks plus CPU
offload's states, checked against the node's memory (a cluster file's node_memory_gib, else the GPU catalog's)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.plan import memory as mem
from llmctl.plan.memory.host import (
    COPY_AHEAD_BYTES,
    CUDA_RUNTIME_HOST_BYTES,
    PROCESS_BYTES,
    host_memory,
    largest_tensor_shard,
)
from llmctl.spec.models import from_preset
from llmctl.spec.setup import MemoryLevers, TrainSetup
from llmctl.units import GIB

SPEC = from_preset("llama-3.1-70b")
SETUP = TrainSetup(strategy="full_shard", nodes=8, gpus_per_node=8, seq_len=8192, attention="flash")


def test_per_node_is_ranks_times_the_rank_plus_offload() -> None:
    est = mem.estimate(SPEC, SETUP)
    h = host_memory(SPEC, SETUP, est, capacity_per_gpu=None)
    # the embedding (128,256 x 8,192) is the largest tensor: a 64th of it per rank
    assert largest_tensor_shard(SPEC, SETUP) == -(-128_256 * 8_192 // 64)
    rank = h.per_rank
    assert rank["process"] == PROCESS_BYTES and rank["CUDA runtime"] == CUDA_RUNTIME_HOST_BYTES
    assert rank["model loading"] == 4 * largest_tensor_shard(SPEC, SETUP)
    assert rank["checkpoint staging"] == 4 * largest_tensor_shard(SPEC, SETUP) + COPY_AHEAD_BYTES
    assert rank["micro-batches"] == 2 * 3 * 8 * 1 * 8193
    assert h.per_node == 8 * sum(rank.values()) and h.offload_per_node == 0
    assert h.fits is None and "not known" in h.line()
    on_cpu = host_memory(SPEC, SETUP, est, None, gpu=False)
    assert "CUDA runtime" not in on_cpu.per_rank and on_cpu.per_node == h.per_node - 8 * CUDA_RUNTIME_HOST_BYTES


def test_offload_states_count_per_node_and_are_checked() -> None:
    off = replace(SETUP, nodes=2, levers=MemoryLevers(offload=True))
    est = mem.estimate(SPEC, off)
    assert est.host_node_bytes > 500 * GIB  # 70B x 16 bytes over 2 nodes
    small = host_memory(SPEC, off, est, capacity_per_gpu=32 * GIB)
    big = host_memory(SPEC, off, est, capacity_per_gpu=192 * GIB)
    assert small.per_node == big.per_node == 8 * sum(big.per_rank.values()) + est.host_node_bytes
    assert small.fits is False and "does NOT fit" in small.line() and "of the node's 256 GiB" in small.line()
    assert big.fits is True and big.line().endswith("fits")


def test_estimate_and_plan_report_it(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["estimate-memory", "llama-3.1-8b", "--gpu", "H100-SXM", "--gpus", "8", "--json"])
    assert r.exit_code == 0, r.output
    host = json.loads(r.output)["host"]
    assert host["ranks_per_node"] == 8 and host["capacity_bytes_per_node"] == 8 * 192 * GIB and host["fits"]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("gpu: H100-SXM\nnodes: 1\ngpus_per_node: 8\nnode_memory_gib: 8\n")
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(
        app, ["plan", "llama-3.1-8b", "--cluster", str(cluster), "--tokens", "1e8", "--json", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["host_memory"]
    assert got["capacity_bytes_per_node"] == 8 * GIB and got["fits"] is False  # 8 ranks of ~1.5 GiB
    assert got["bytes_per_node"] == 8 * sum(got["per_rank_bytes"].values())


def test_qlora_loads_each_block_linear_whole_on_every_rank() -> None:
    """QLoRA quantizes every block linear whole on each rank (llmctl.engine.qlora.fill): the largest one (70B's MLP,
    28,672 x 8,192) in fp32, not a 64th of the embedding, is what building the model holds on the host."""
    from llmctl.spec.finetune import Finetune

    q = replace(SETUP, finetune=Finetune("qlora", 16))
    h = host_memory(SPEC, q, mem.estimate(SPEC, q), capacity_per_gpu=None)
    assert h.per_rank["model loading"] == 4 * 28_672 * 8_192
    lora = replace(SETUP, finetune=Finetune("lora", 16))
    assert host_memory(SPEC, lora, mem.estimate(SPEC, lora), None).per_rank[
        "model loading"
    ] == 4 * largest_tensor_shard(SPEC, lora)
