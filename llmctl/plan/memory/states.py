"""The model states of a setup: full training's ledger (llmctl.plan.memory.ledger) or, with adapters, the frozen base
and the adapters' lines (llmctl.plan.memory.adapters), which build on the ledger's (torch-free)."""

from __future__ import annotations

from dataclasses import replace

from llmctl.plan.memory.adapters import adapter_ledger
from llmctl.plan.memory.ledger import StateLine, full_ledger, model_bytes_per_param
from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import MemoryLevers, TrainSetup


def state_ledger(spec: ModelSpec, setup: TrainSetup) -> list[StateLine]:
    """The model-state lines of the setup's precision policy and optimizer, each with the ZeRO stage that shards it."""
    if setup.finetune.adapters:
        return adapter_ledger(spec, setup)
    return full_ledger(spec, setup)


def classic_bytes_per_param(spec: ModelSpec, setup: TrainSetup) -> float:
    """The model-state budget before sharding with a persistent half copy (18 for mixed-precision AdamW). With adapters
    (FSDP2 only) the ledger's own bytes per model parameter (model_bytes_per_param)."""
    if setup.finetune.adapters:
        return model_bytes_per_param(spec, state_ledger(spec, setup))
    return sum(
        line.bytes_per_param
        for line in full_ledger(spec, replace(setup, engine="zero", strategy="no_shard", ep=1, levers=MemoryLevers()))
    )
