"""Activations under tensor and context parallelism: what autograd saves for backward on each rank of FSDP2 2 x TP 2
(torch's sequence parallelism, as the engine applies it), and of cp 2 and cp 4 (torch's ring attention on the rank's
part of the sequence), against the estimate's activation lines, within 3%.

One 4-rank torchrun of tests/engine/tp_act_worker.py runs every case: the engine's own model build, TP -> activation
checkpointing -> FSDP2 and loss parallel, one forward under the saved-bytes harness (DTensors counted by their
local tensors, each storage once). Widths are large enough (hidden 256, 512 tokens per micro-batch) that activations
dominate the few bytes the estimate leaves out (position ids, the loss's scalar weight).

Megatron's rule, "everything divides by tp" (Korthikanti et al. 2022), is what the estimate assumed before torch's
layout was modelled; each case also checks that the rule misses by more than the tolerance (9-26% low here: torch
keeps the all-gathered inputs of q/k/v and gate/up, the LM head's gathered input, a checkpointed first layer's whole
input, and the rotary tables whole), so the test tells the two layouts apart.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engine.conftest import REPO, TINY, deep_update, torchrun_script
from tests.family_configs import tiny

pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.engine.model import model_spec_for  # noqa: E402
from llmctl.plan import memory as mem  # noqa: E402
from llmctl.spec.planfile import Plan, load_plan  # noqa: E402

TOLERANCE = 0.03
WIDTHS = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
}
# (family, checkpointing, precision, micro-batch, sequence): the SDPA kernel throughout (flash's layout on a GPU).
CASES = [
    ("llama", "none", "fp32", 2, 256),
    ("llama", "full", "fp32", 2, 256),
    ("qwen3", "none", "fp32", 4, 128),
    ("qwen3", "full", "fp32", 4, 128),
    ("llama", "selective", "bf16-mixed", 2, 256),  # the planner's favourite mode; bf16's fp32 norm copies
    ("qwen3", "none", "bf16-mixed", 2, 256),  # per-head q/k norms on this rank's heads, in bf16
    ("olmo2", "none", "fp32", 2, 256),  # q/k norms over all heads: q and k gathered and normed at their whole width
]
IDS = [f"{f}-{c}-{p}-b{b}-s{s}" for f, c, p, b, s in CASES]
# (family, checkpointing, precision, micro-batch, sequence, the parallel section) on 4 ranks.
CP_CASES = [
    ("llama", "none", "fp32", 2, 256, {"cp": 2}),
    ("llama", "none", "fp32", 2, 256, {"cp": 4, "cp_rotate": "alltoall"}),
    ("llama", "none", "fp32", 2, 256, {"cp": 2, "cp_load_balance": False}),
    ("llama", "full", "fp32", 2, 256, {"cp": 4}),
    ("qwen3", "selective", "bf16-mixed", 2, 256, {"cp": 2}),
    ("llama", "none", "bf16-mixed", 2, 256, {"cp": 2, "tp": 2}),
]
CP_IDS = [
    f"{f}-{c}-{p}-b{b}-s{s}-" + "-".join(f"{k}{v}".replace("_", "") for k, v in par.items())
    for f, c, p, b, s, par in CP_CASES
]
SAVED = ("activations (", "final norm + LM-head input", "loss log-softmax")
"""The estimate's lines that are held from forward to backward: the blocks (and what they share), the final norm and
the LM head's input, the loss's log-softmax."""


def write_plan(
    folder: Path, family: str, ckpt: str, precision: str, b: int, s: int, parallel: dict[str, Any] | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.json"
    config.write_text(json.dumps(tiny(family, **WIDTHS)))
    plan = deep_update(
        TINY,
        {
            "hardware": {"nproc_per_node": 4},
            "parallel": parallel or {"tp": 2},
            "training": {
                "precision": precision,
                "micro_batch_size": b,
                "seq_len": s,
                "activation_checkpointing": ckpt,
                "attention": "sdpa",
            },
            "logging": {"dir": str(folder / "logs")},
        },
    )
    plan["model"] = {"config": str(config)}
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("tp-act")
    plans = {name: write_plan(root / name, *case) for name, case in zip(IDS, CASES, strict=True)}
    plans.update({name: write_plan(root / name, *case) for name, case in zip(CP_IDS, CP_CASES, strict=True)})
    out = root / "saved.json"
    proc = torchrun_script(
        REPO / "tests" / "engine" / "tp_act_worker.py", [str(out), *map(str, plans.values())], 4, root, timeout=600
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    return {name: (path, res[str(path)]) for name, path in plans.items()}


def saved_lines(plan: Plan, tp: int | None = None) -> dict[str, int]:
    """The estimate's saved-for-backward lines for the plan's model as the engine builds it (padded vocabulary), at
    the plan's tp or another."""
    setup = plan.setup if tp is None else replace(plan.setup, tp=tp)
    est = mem.estimate(model_spec_for(plan.model), setup)
    return {c.name: c.bytes for c in est.components if c.name.startswith(SAVED)}


@pytest.mark.parametrize("case", IDS)
def test_saved_per_rank_matches_the_estimate(measured: dict, case: str) -> None:
    path, got = measured[case]
    assert "error" not in got, got.get("error")
    plan = load_plan(path)
    predicted = sum(saved_lines(plan).values())
    for rank, regions in enumerate(got["ranks"]):
        total = sum(regions.values())
        assert abs(predicted / total - 1) <= TOLERANCE, (case, rank, predicted, total, regions)
    # Megatron's rule (every line of the unsplit estimate divided by tp), as the estimate had it, misses.
    total = sum(got["ranks"][0].values())
    megatron = sum(v // plan.setup.tp for v in saved_lines(plan, tp=1).values())
    assert abs(megatron / total - 1) > TOLERANCE, (case, megatron, total)


@pytest.mark.parametrize("case", IDS)
def test_each_block_and_the_head_match(measured: dict, case: str) -> None:
    """Block by block (the first also holds what all blocks share, and, checkpointed, the whole sequence as its
    input), then the final norm and the LM head's input."""
    path, got = measured[case]
    assert "error" not in got, got.get("error")
    plan = load_plan(path)
    spec, setup = model_spec_for(plan.model), plan.setup
    b, s, ab, ck, tp = setup.micro_batch_size, setup.seq_len, setup.compute_bytes, setup.checkpointing, setup.tp
    regions = got["ranks"][0]
    for i, layer in enumerate(spec.layers):
        predicted = mem.layer_saved_bytes(spec, b, s, ab, "sdpa", ck, layer, tp, first=i == 0)
        predicted += mem.shared_activation_bytes(spec, b, s, ab, "sdpa") if i == 0 else 0
        assert abs(predicted / regions[str(i)] - 1) <= TOLERANCE, (case, i, predicted, regions[str(i)])
    head = mem.head_activation_bytes(spec, b, s, ab, tp) - 8 * b * s * 2  # the ids are saved outside (embedding, loss)
    assert abs(head / (regions["norm"] + regions["head"]) - 1) <= TOLERANCE, (case, head, regions)


@pytest.mark.parametrize("case", CP_IDS)
def test_saved_per_rank_under_cp_matches_the_estimate(measured: dict, case: str) -> None:
    """The worst rank of a cp run holds what the estimate says to 3%, and no rank holds less than 6% under it: with
    the head-tail balance the ranks whose ring has a half-block step (all but the last) keep one more attention
    output per layer (the merge's partial update leaves it contiguous in (b, heads, s, d), so transformers'
    transpose(1, 2).contiguous() before o_proj copies it, where the kernel's own (b, s, heads, d) layout does not)."""
    path, got = measured[case]
    assert "error" not in got, got.get("error")
    plan = load_plan(path)
    predicted = sum(saved_lines(plan).values())
    totals = [sum(regions.values()) for regions in got["ranks"]]
    assert abs(predicted / max(totals) - 1) <= TOLERANCE, (case, predicted, totals)
    assert abs(predicted / min(totals) - 1) <= TOLERANCE + 0.03, (case, predicted, totals)
