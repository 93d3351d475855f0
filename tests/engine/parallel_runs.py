"""The one 4-rank torchrun that trains every tensor- and context-parallel case against its data-parallel reference
(tests/engine/parallel_worker.py), shared by test_tensor_parallel.py and test_context_parallel.py: a torchrun costs
~10 s of CPU before the first step, so the cases join one launch.

A case is (reference plan, parallel plan): the reference is the family's tiny config on FSDP2 over 4 ranks at
micro-batch 2; the parallel plan puts tp x cp = k ranks on one micro-batch of 2k sequences (the same global batch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engine.conftest import REPO, TINY, deep_update, torchrun_script
from tests.family_configs import tiny

NO_SDPA = ("gemma2", "gpt_oss")  # transformers builds them without an SDPA path
CP_CASES: dict[str, dict[str, Any]] = {
    # name: (family, the parallel section, nodes); fp32, seq_len 32 (8 chunks of 4 tokens at cp 4)
    "llama-cp2": {"family": "llama", "parallel": {"cp": 2}},
    "llama-cp2-unbalanced-alltoall": {
        "family": "llama",
        "parallel": {"cp": 2, "cp_load_balance": False, "cp_rotate": "alltoall"},
    },
    "llama-cp4-alltoall": {"family": "llama", "parallel": {"cp": 4, "cp_rotate": "alltoall"}},
    "llama-tp2-cp2": {"family": "llama", "parallel": {"cp": 2, "tp": 2}},
    "llama-hsdp-cp2": {"family": "llama", "parallel": {"cp": 2, "sharding": "hybrid_shard"}, "nodes": 2},
    "qwen3-cp2": {"family": "qwen3", "parallel": {"cp": 2}},
    "qwen3-cp2-unbalanced": {"family": "qwen3", "parallel": {"cp": 2, "cp_load_balance": False}},
    "mixtral-cp2": {"family": "mixtral", "parallel": {"cp": 2}},
}
EP_CASES: dict[str, dict[str, Any]] = {
    # expert parallelism borrows data-parallel ranks: each rank keeps the reference rank's micro-batch; 4 experts
    "qwen3_moe-ep2": {"family": "qwen3_moe", "parallel": {"ep": 2}},  # efsdp 2 x ep 2
    "qwen3_moe-ep4": {"family": "qwen3_moe", "parallel": {"ep": 4}},  # efsdp 1
    "qwen3_moe-hsdp-ep2": {"family": "qwen3_moe", "parallel": {"ep": 2, "sharding": "hybrid_shard"}, "nodes": 2},
    "mixtral-ep2": {"family": "mixtral", "parallel": {"ep": 2}},
    "deepseek_v3-ep2": {"family": "deepseek_v3", "parallel": {"ep": 2}},  # fp32 router, shared experts
    "gpt_oss-ep4": {"family": "gpt_oss", "parallel": {"ep": 4}},  # transposed, interleaved gate/up, biases
    "qwen3_moe-ep2-cp2": {"family": "qwen3_moe", "parallel": {"ep": 2, "cp": 2}},  # ep over dp_shard 2 x cp 2
}


def case_plan(folder: Path, family: str, name: str, parallel: dict[str, Any], nodes: int = 1) -> Path:
    """`family`'s tiny config trained 5 steps (fp32, lr 3e-3, no clipping) with `parallel` on 4 ranks."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.json"
    config.write_text(json.dumps(tiny(family)))
    k = parallel.get("tp", 1) * parallel.get("cp", 1)
    plan = deep_update(
        TINY,
        {
            "hardware": {"nodes": nodes, "nproc_per_node": 4 // nodes},
            "parallel": {"sharding": "full_shard", **parallel},
            "training": {
                "max_steps": 5,
                "seq_len": 32,
                "micro_batch_size": 2 * k,
                "grad_clip": None,
                "attention": "eager" if family in NO_SDPA else "sdpa",
            },
            "optimizer": {"lr": 3e-3, "warmup_steps": 0},
            "logging": {"dir": str(folder / f"logs-{name}")},
        },
    )
    plan["model"] = {"config": str(config)}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def train_cases(root: Path, tp_families: list[str]) -> dict[str, Any]:
    """Every case trained in one launch: {case: (reference result, parallel result)} and "_plans": {case: (reference
    plan, parallel plan)}. A result is {"losses", "grad_norms", "grads", "state_bytes"} or {"error"}."""
    refs: dict[str, Path] = {}

    def ref(family: str) -> Path:
        if family not in refs:
            refs[family] = case_plan(root / family, family, "reference", {})
        return refs[family]

    cases: dict[str, tuple[Path, Path]] = {}
    for family in tp_families:
        cases[family] = (ref(family), case_plan(root / family, family, "tp2", {"tp": 2}))
    # tp over all 4 ranks (dp 1, no FSDP): the parameters the plan keeps whole (MLA's latent projections, the MoE
    # block) stay plain tensors next to DTensors, which the fused AdamW refuses (llmctl.engine.optim)
    cases["deepseek_v3-tp4"] = (ref("deepseek_v3"), case_plan(root / "deepseek_v3", "deepseek_v3", "tp4", {"tp": 4}))
    cases["llama-hsdp"] = (
        ref("llama"),
        case_plan(root / "llama", "llama", "hsdp-tp2", {"tp": 2, "sharding": "hybrid_shard"}, nodes=2),
    )
    for name, c in {**CP_CASES, **EP_CASES}.items():
        cases[name] = (
            ref(c["family"]),
            case_plan(root / c["family"], c["family"], name, c["parallel"], c.get("nodes", 1)),
        )
    out = root / "results.json"
    plans = list(dict.fromkeys(p for pair in cases.values() for p in pair))
    proc = torchrun_script(
        REPO / "tests" / "engine" / "parallel_worker.py", [str(out), *map(str, plans)], 4, root, {}, 1500
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    found: dict[str, Any] = {name: (res[str(a)], res[str(b)]) for name, (a, b) in cases.items()}
    found["_plans"] = cases
    found["_ring"] = res["_ring"]
    return found


def assert_trains_like_reference(ref: dict[str, Any], got: dict[str, Any]) -> None:
    """Losses and global gradient norms of 5 steps within 1e-5, and every parameter's whole gradient after the first
    backward within 1e-5: a wrong split (a gradient not summed over a group, a token counted twice, a position
    shifted) shows in the gradients even where the loss hides it."""
    assert "error" not in ref, ref.get("error")
    assert "error" not in got, got.get("error")
    assert len(got["losses"]) == 5
    for a, b in zip(ref["losses"], got["losses"], strict=True):
        assert abs(a - b) <= 1e-5, (ref["losses"], got["losses"])
    for a, b in zip(ref["grad_norms"], got["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, a), (ref["grad_norms"], got["grad_norms"])
    assert ref["losses"][-1] < ref["losses"][0]  # it trained
    assert set(ref["grads"]) == set(got["grads"])
    for name, g in ref["grads"].items():
        h = got["grads"][name]
        worst = max(abs(x - y) for x, y in zip(g, h, strict=True))
        assert worst <= 1e-5, f"{name}: gradients differ by {worst:.2e}"


@pytest.fixture(scope="session")
def parallel_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
    pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")
    from llmctl.families import REGISTRY

    tp_families = [mt for mt, f in REGISTRY.items() if f.tp_plan is not None]
    return train_cases(tmp_path_factory.mktemp("parallel"), tp_families)
