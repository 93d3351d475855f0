"""The fewest GPUs that fit, over every layout the planner searches (llmctl.plan.memory.fewest): estimate-memory, plan's
refusal and --compare give the same count, and the plan on that count fits (issue 48)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.errors import DoesNotFitError
from llmctl.plan import comm as cm
from llmctl.plan import memory as mem
from llmctl.plan import planner as pl
from llmctl.plan.memory.fewest import fewest
from llmctl.plan.space import auto_loss_chunk
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.models import resolve_model
from llmctl.spec.setup import TrainSetup
from tests.plan.requests import plan_request

RTX = resolve_gpu("RTX-4090")
NET = cm.Network(RTX.link_gbytes_s * cm.DEFAULT_LINK_EFFICIENCY, 25 / 8)


def test_405b_on_rtx_4090_names_a_count_and_the_plan_on_it_fits() -> None:
    """At tp 1 no count of 24 GB cards holds Llama-3.1-405B (its layers in flight and activations alone outgrow one);
    with tp 8 some does, and the plan on exactly that many fits."""
    spec = resolve_model("llama-3.1-405b")
    with pytest.raises(
        DoesNotFitError, match=r"smallest cluster of RTX-4090 that fits is \d+ nodes x 8 .* with tp"
    ) as e:
        pl.plan(plan_request(spec=spec, gpu=RTX, nodes=1, gpus_per_node=8, network=NET, seq_len=2048, offload=False))
    n = e.value.fewest_gpus
    assert n is not None and n % 8 == 0
    req = plan_request(
        spec=spec, gpu=RTX, nodes=n // 8, gpus_per_node=8, network=NET, seq_len=2048, offload=False, nodes_exact=True
    )
    chosen = pl.plan(req).chosen
    assert chosen.setup.nodes * 8 == n and chosen.predicted.memory_per_gpu_bytes <= req.capacity_bytes
    # at tp 1 (what the answer was before) nothing fits at all
    tp1 = TrainSetup(precision="bf16-mixed", nodes=1, gpus_per_node=8, seq_len=2048, checkpointing="full")
    assert mem.min_gpus(spec, tp1, req.capacity_bytes, "full_shard").gpus is None


def test_it_is_no_more_than_any_one_layout_and_one_node_fewer_does_not_fit() -> None:
    spec, h100 = resolve_model("llama-3.1-70b"), resolve_gpu("H100-SXM")
    cap = int(h100.memory_bytes * 0.94)
    base = TrainSetup(
        precision="bf16-mixed",
        gpus_per_node=8,
        seq_len=4096,
        checkpointing="full",
        loss_chunk_tokens=auto_loss_chunk(spec),
    )
    f = fewest(spec, base, cap)
    assert f is not None
    tp1 = mem.min_gpus(spec, base, cap, "full_shard").gpus
    tp8 = mem.min_gpus(spec, TrainSetup(**{**_fields(base), "tp": 8, "loss_chunk_tokens": 0}), cap, "full_shard").gpus
    assert f.gpus <= min(n for n in (tp1, tp8) if n)
    fewer = f.setup.__class__(**{**_fields(f.setup), "nodes": max(1, f.nodes - 1)}) if f.nodes > 1 else None
    if fewer is not None:
        assert mem.estimate(spec, fewer).device_bytes > cap


def _fields(s: TrainSetup) -> dict:
    from dataclasses import fields

    return {x.name: getattr(s, x.name) for x in fields(s) if x.init}


def test_estimate_memory_prints_and_returns_it() -> None:
    r = CliRunner().invoke(
        app, ["estimate-memory", "llama-3.1-405b", "--gpu", "RTX-4090", "--seq-len", "2048", "--json"]
    )
    assert r.exit_code == 0, r.output
    f = json.loads(r.stdout)["fewest_any_layout"]
    assert f["tp"] == 8 and f["gpus"] % 8 == 0 and f["per_gpu_total_bytes"] <= RTX.memory_bytes
    with pytest.raises(DoesNotFitError) as e:  # plan's refusal names the same count
        pl.plan(
            plan_request(
                spec=resolve_model("llama-3.1-405b"),
                gpu=RTX,
                nodes=1,
                gpus_per_node=8,
                network=NET,
                seq_len=2048,
                offload=False,
            )
        )
    assert e.value.fewest_gpus == f["gpus"]
    text = CliRunner().invoke(app, ["estimate-memory", "llama-3.1-405b", "--gpu", "RTX-4090", "--seq-len", "2048"])
    assert f"fewest RTX-4090 GPUs in any layout the planner searches (tp, cp, pp): {f['gpus']} " in text.stdout
