"""Planner requests for the tests, with the pins as keywords (`tp=2`, `offload=True`): `PlanRequest` takes them as one
mapping by decision name (llmctl.spec.decisions)."""

from __future__ import annotations

from typing import Any

from llmctl.plan.request import PlanRequest
from llmctl.spec.decisions import declared
from llmctl.spec.setup import TrainSetup

PINNABLE = {d.name for d in declared(TrainSetup) if d.search is not None} | {"micro_batch"}


def plan_request(**kw: Any) -> PlanRequest:
    """PlanRequest(**kw) with the searched decisions among the keywords as its pins (`micro_batch`: the micro-batch)."""
    pins = dict(kw.pop("pins", {}))
    for name in [k for k in kw if k in PINNABLE]:
        pins["micro_batch_size" if name == "micro_batch" else name] = kw.pop(name)
    return PlanRequest(**kw, pins=pins)
