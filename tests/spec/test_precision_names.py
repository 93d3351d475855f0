"""Every precision name the tool suggests is one it accepts, and only llmctl.spec.precision interprets them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmctl.spec.precision import ALIASES, POLICIES, for_gpu, policy

PKG = Path(__file__).resolve().parents[2] / "llmctl"


def test_every_suggested_precision_is_accepted() -> None:
    """`--precision X` in any message, hint or help of the package (a V100's "use --precision fp16 or fp32" once
    named a value the tool refused)."""
    found = set()
    for path in PKG.rglob("*.py"):
        for m in re.finditer(r"--precision ([a-z0-9][a-z0-9-]*)(?: or ([a-z0-9][a-z0-9-]*))?", path.read_text()):
            found.update(x for x in m.groups() if x)
    assert {"fp16", "fp32", "bf16-mixed"} <= found
    for name in found - {"auto"}:
        policy(name)


def test_aliases_point_at_policies_and_shadow_none() -> None:
    assert set(ALIASES.values()) <= set(POLICIES)
    assert not set(ALIASES) & set(POLICIES)


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [("V100-16GB", "fp16-mixed"), ("T4", "fp16-mixed"), ("A100-80GB", "bf16-mixed"), ("H100-SXM", "bf16-mixed")],
)
def test_auto_is_the_gpus_best_half_precision(gpu: str, expected: str) -> None:
    from llmctl.spec.hardware import resolve_gpu

    p, why = for_gpu("auto", resolve_gpu(gpu))
    assert p.name == expected
    assert (why is not None) == (expected == "fp16-mixed")
    assert for_gpu(None, None)[0].name == "bf16-mixed"  # no GPU named (a CPU run's estimate)
