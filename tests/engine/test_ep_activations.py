"""What one MoE layer's experts save for backward at ep > 1, measured (tests/engine/ep_saved_worker.py: the engine's
dispatching forward, llmctl.engine.experts.dispatch_forward, over an ep group of one gloo rank, and transformers' own
experts forward, for every MoE family in fp32 and bf16), against llmctl.plan.memory.experts: the dispatch's saved
bytes exactly, and the ep 1 loop's the estimate subtracts from its activations to within a few bytes per row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmctl.plan.memory import experts as ex
from llmctl.spec.models import from_hf_config
from tests.engine.conftest import REPO
from tests.family_configs import tiny

pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    r = subprocess.run(
        [sys.executable, "-m", "tests.engine.ep_saved_worker"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dispatch_saved_bytes_exact(measured: list[dict]) -> None:
    assert len(measured) == 8
    for r in measured:
        spec = from_hf_config(tiny(r["family"]), name=r["family"])
        layer = next(la for la in spec.layers if la.mlp.moe)
        ab = 4 if r["dtype"] == "torch.float32" else 2
        predicted = ex.dispatch_saved_bytes(spec, layer, r["tokens"], 1, ab)
        assert r["dispatch"] / predicted == 1.0, r  # ratio 1.00
        # the ep 1 loop's line (activations' "moe dispatched tokens") within 2 bytes per row and its offsets
        rows = r["tokens"] * layer.mlp.experts_per_token
        assert abs(r["loop"] - ex.loop_saved_bytes(spec, layer, r["tokens"], ab)) <= 2 * rows + 16, r
