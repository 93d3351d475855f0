"""The plan each trial runs: the base plan with the candidate's setup, for warm-up + N steps, every step logged, without
checkpoints, validation or loggers (torch-free)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from llmctl.errors import InputError
from llmctl.plan import comm as cm
from llmctl.plan.emit import predicted_section
from llmctl.plan.timing import Candidate
from llmctl.spec import planfile as pf

FAIL_ENV = "LLMCTL_TUNE_FAIL_TRIALS"
"""Test hook: comma-separated trial numbers (1-based, in run order) whose plan reads a data file that does not
exist, so that the engine fails at start, through the path a crash or an out-of-memory error takes (one line in
$LLMCTL_ERROR_FILE, a non-zero exit); tuning goes on with the other trials."""


# --- trial plans -----------------------------------------------------------------------------------------------------
def apply_setup(
    plan: pf.Plan, cand: Candidate, with_prediction: bool, source: str, network: cm.Network | None = None
) -> pf.Plan:
    """The plan with the candidate's setup (everything else as it was) and its prediction (without: an empty
    `predicted:`)."""
    planned = plan.with_setup(cand.setup, source)
    data = planned.model_dump(mode="json")
    data["predicted"] = predicted_section(cand, network) if with_prediction else {}
    return pf.plan_from_dict(data, source)


def trial_plan(
    base: pf.Plan,
    cand: Candidate,
    number: int,
    folder: Path,
    steps: int,
    warmup: int,
    with_prediction: bool,
    fail: bool = False,
    network: cm.Network | None = None,
) -> pf.Plan:
    """What trial `number` runs: the base plan with the candidate's setup, for warmup + steps steps, every step
    logged to folder/logs/metrics.jsonl; no checkpoints (a trial must neither resume from nor overwrite the run's),
    no validation, no TensorBoard/W&B. `fail`: the FAIL_ENV hook."""
    plan = apply_setup(base, cand, with_prediction, f"trial {number}", network)
    data = plan.model_dump(mode="json")
    data["name"] = f"{base.name[:200]}-tune-{number}"
    data["training"].update(max_steps=warmup + steps, token_budget=None)
    data["checkpoint"]["dir"] = None
    data["logging"].update(dir=str(folder / "logs"), interval_steps=1, tensorboard=False, wandb=None)
    data["data"]["val"] = None
    if fail:
        data["data"] = {"kind": "text", "paths": [str(folder / f"missing-on-purpose-{FAIL_ENV}.txt")]}
    return pf.plan_from_dict(data, f"the plan of trial {number}")


def failing_trials(environ: Mapping[str, str] | None = None) -> set[int]:
    """The trial numbers FAIL_ENV names (bad entries: one line)."""
    raw = (environ if environ is not None else os.environ).get(FAIL_ENV, "")
    out = set()
    for part in filter(None, (p.strip() for p in raw.split(","))):
        if not part.isdigit():
            raise InputError(f"${FAIL_ENV}: expected trial numbers like 2 or 1,3, got {raw!r}")
        out.add(int(part))
    return out
