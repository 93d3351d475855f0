"""Would this plan produce anything? A launched plan that trains on random tokens or saves no checkpoint burns its
GPUs for nothing (no SIGUSR1 checkpoint, no requeue resume, nothing for `llmctl export`): `llmctl launch` refuses
it unless told so, and `--dry-run` warns. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from llmctl.errors import InputError
from llmctl.spec.planfile import Plan


@dataclass(frozen=True)
class Problem:
    what: str
    """One line: what the plan would do."""
    fix: str
    """How to give it what it lacks."""
    allow: str
    """The launch flag that says it is meant."""


def problems(plan: Plan, source: str) -> list[Problem]:
    """What makes `plan` (read from `source`) a run that produces nothing, in the order a user fixes them."""
    out = []
    if plan.data.kind == "synthetic":
        out.append(
            Problem(
                f"{source} trains on synthetic data (random tokens: data.kind synthetic)",
                "plan it with `llmctl plan ... --data PATH` (a folder made by `llmctl data prepare`, or .txt/.jsonl "
                "files) or set data: in the plan",
                "--allow-synthetic",
            )
        )
    if plan.checkpoint.dir is None:
        out.append(
            Problem(
                f"{source} saves no checkpoint (checkpoint.dir is null): no SIGUSR1 checkpoint, no resume after a "
                "requeue, nothing for `llmctl export`",
                "plan it with `llmctl plan ... --run-dir DIR` or set checkpoint.dir in the plan",
                "--allow-no-checkpoint",
            )
        )
    return out


def check(plan: Plan, source: str, dry_run: bool, allow_synthetic: bool, allow_no_checkpoint: bool) -> list[str]:
    """`llmctl launch`'s verdict: the first problem not allowed is one InputError line naming the fix; with
    --dry-run (nothing runs) the problems are returned as warnings instead."""
    allowed = {"--allow-synthetic": allow_synthetic, "--allow-no-checkpoint": allow_no_checkpoint}
    warnings = []
    for p in problems(plan, source):
        if allowed[p.allow]:
            continue
        if not dry_run:
            raise InputError(p.what, hint=f"{p.fix}; or pass {p.allow} if that is meant")
        warnings.append(f"{p.what}; launched, it is refused until you {p.fix}, or pass {p.allow}")
    return warnings
