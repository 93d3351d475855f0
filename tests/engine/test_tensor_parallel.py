"""Tensor parallelism (with sequence parallelism) in the engine: every family with a plan trains 5 steps on FSDP2 2 x
TP 2 exactly as on FSDP2 over 4 ranks with the same global batch (fp32: losses and every gradient within 1e-5), and
each rank holds a quarter of the model's parameter, gradient and AdamW bytes (1/dp of the unsplit ones). One 4-rank
torchrun of tests/engine/tp_worker.py trains every pair."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engine.conftest import REPO, TINY, deep_update, torchrun_script
from tests.family_configs import tiny

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.errors import SpecError  # noqa: E402
from llmctl.families import REGISTRY  # noqa: E402

TP_FAMILIES = [mt for mt, f in REGISTRY.items() if f.tp_plan is not None]
NO_SDPA = ("gemma2",)


def pair(folder: Path, family: str, hybrid: bool = False) -> tuple[Path, Path]:
    """(reference: FSDP2 over 4 ranks at micro-batch 2, FSDP2 2 x TP 2 at micro-batch 4) for `family`'s tiny config;
    `hybrid`: the TP run on 2 nodes x 2 ranks with HSDP, the 3-D mesh (replicate 2, shard 1, tp 2)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.json"
    config.write_text(json.dumps(tiny(family)))
    out = []
    for tp, mb in ((1, 2), (2, 4)):
        plan = deep_update(
            TINY,
            {
                "hardware": {"nodes": 2, "nproc_per_node": 2} if hybrid and tp > 1 else {"nproc_per_node": 4},
                "parallel": {"tp": tp, "sharding": "hybrid_shard" if hybrid and tp > 1 else "full_shard"},
                "training": {
                    "max_steps": 5,
                    "seq_len": 32,
                    "micro_batch_size": mb,
                    "grad_clip": None,
                    "attention": "eager" if family in NO_SDPA else "sdpa",
                },
                "optimizer": {"lr": 3e-3, "warmup_steps": 0},
                "logging": {"dir": str(folder / f"logs{tp}")},
            },
        )
        plan["model"] = {"config": str(config)}
        path = folder / f"tp{tp}.yaml"
        path.write_text(yaml.safe_dump(plan, sort_keys=False))
        out.append(path)
    return out[0], out[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    root = tmp_path_factory.mktemp("tp")
    pairs = {mt: pair(root / mt, mt) for mt in TP_FAMILIES}
    pairs["llama-hsdp"] = pair(root / "llama-hsdp", "llama", hybrid=True)
    out = root / "results.json"
    args = [str(out)] + [str(p) for ab in pairs.values() for p in ab]
    proc = torchrun_script(REPO / "tests" / "engine" / "tp_worker.py", args, 4, root, {}, timeout=1200)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    found: dict[str, Any] = {mt: (res[str(a)], res[str(b)]) for mt, (a, b) in pairs.items()}
    found["_plans"] = pairs
    return found


@pytest.mark.parametrize("family", [*TP_FAMILIES, "llama-hsdp"])
def test_tp_trains_like_data_parallel(trained: dict, family: str) -> None:
    ref, tp = trained[family]
    assert "error" not in ref, ref.get("error")
    assert "error" not in tp, tp.get("error")
    assert len(tp["losses"]) == 5
    for a, b in zip(ref["losses"], tp["losses"], strict=True):
        assert abs(a - b) <= 1e-5, (ref["losses"], tp["losses"])
    for a, b in zip(ref["grad_norms"], tp["grad_norms"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, a), (ref["grad_norms"], tp["grad_norms"])
    assert ref["losses"][-1] < ref["losses"][0]  # it trained
    # Every parameter's whole gradient after the first backward: a wrong split (a norm's gradient not summed over
    # the tp group, a replicated block's counted twice) shows here even where the loss hides it.
    assert set(ref["grads"]) == set(tp["grads"])
    for name, g in ref["grads"].items():
        h = tp["grads"][name]
        worst = max(abs(x - y) for x, y in zip(g, h, strict=True))
        assert worst <= 1e-5, f"{name}: gradients differ by {worst:.2e}"


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp_ranks_hold_what_the_estimate_says(trained: dict, family: str, tmp_path_factory) -> None:
    """Every rank's bytes of parameters, gradients and AdamW states under FSDP2 2 x TP 2 equal estimate-memory's
    lines (norms and MoE blocks replicated over the tp group, the rest split), to 0.5%; and the reference's 4 ranks
    hold together the whole model once (so the TP run holds more only by what it replicates)."""
    from llmctl.engine.dryrun import estimated_lines
    from llmctl.spec.planfile import load_plan

    ref, tp = trained[family]
    plan = load_plan(trained["_plans"][family][1])
    est = estimated_lines(plan)
    for kind in ("parameters", "gradients", "optimizer"):
        for r, rank in enumerate(tp["state_bytes"]):
            assert abs(rank[kind] / est[kind] - 1) <= 0.005, (family, kind, r, rank[kind], est[kind])
    ref_plan = load_plan(trained["_plans"][family][0])
    whole = sum(r["parameters"] for r in ref["state_bytes"])
    assert abs(whole / (4 * estimated_lines(ref_plan)["parameters"]) - 1) <= 0.005


@pytest.mark.parametrize("family", [mt for mt, f in REGISTRY.items() if f.tp_plan is None])
def test_a_family_without_a_plan_is_refused_in_one_line(family: str) -> None:
    from llmctl.engine.tensor_parallel import apply_tp

    cfg = tiny(family)
    config = __import__("transformers").AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = __import__("transformers").AutoModelForCausalLM.from_config(config)
    with pytest.raises(SpecError) as e:
        apply_tp(model, None)
    assert "cannot use tensor parallelism" in e.value.message and "\n" not in e.value.message
