"""A tensor- or context-parallel run's checkpoint (DCP, DTensors split over data x tp, or over data x cp) resumes at
another degree and exports like a data-parallel one: in one 4-rank launch of the engine's entry point
(tests/engine/engine_runs.py), a run saved at tp 2 resumes at tp 1, is saved again and resumes at tp 4; another saved
at cp 2 on 2 ranks resumes at FSDP 2 x cp 2 (with the chunked loss) and then at cp 4 (all-to-all rotation, full
activation checkpointing: the ring runs again in the recompute); a third saved at pp 2 (1F1B, 2 ranks) resumes at
FSDP 2 (pp 1) and then at pp 2 x FSDP 2 (interleaved 1F1B: other stages); a tiny MoE saved at ep 2 resumes at ep 1
and then at ep 2 x efsdp 2 (against its own FSDP run). Their losses and validation losses
(evaluated with the sequence split, or through the pipeline, too) are the uninterrupted data-parallel run's (within
1e-5, fp32, constant learning rate so that the schedule does not depend on each leg's length) and `llmctl export` of
the last tp checkpoint (saved at tp 4), of the last pp one and of the last ep one give the data-parallel run's Hugging
Face folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engine.conftest import CORPUS, TINY, check_ok, deep_update, losses, records, run_engine_plans

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

VAL = sorted(CORPUS.glob("*.txt"))[0]
GLOBAL_BATCH = 8  # sequences per step: micro-batch x data-parallel ranks in every leg


def leg(root: Path, name: str, ranks: int, tp: int, steps: int, ckpt: Path, cp: dict[str, Any] | None = None) -> Path:
    """A leg of `steps` (its last step) on `ranks` at tp, or with `cp` (the parallel section's cp or pp keys and the
    training keys it changes: loss_chunk_tokens, activation_checkpointing, grad_accum_steps)."""
    folder = root / name
    folder.mkdir(parents=True)
    cp = dict(cp or {})
    training = {k: cp.pop(k) for k in ("loss_chunk_tokens", "activation_checkpointing", "grad_accum_steps") if k in cp}
    share = tp * cp.get("cp", 1) * cp.get("pp", 1)  # ranks on one micro-batch
    acc = training.get("grad_accum_steps", 1)
    over: dict[str, Any] = {
        # 8 heads and 4 kv heads (head_dim 8): tp 4 holds 2 heads and 1 kv head per rank
        "model": {"overrides": {"num_attention_heads": 8, "num_key_value_heads": 4}},
        "hardware": {"nproc_per_node": ranks},
        "parallel": {"tp": tp, **cp},
        "training": {
            "max_steps": steps,
            "seq_len": 32,
            "micro_batch_size": GLOBAL_BATCH * share // (ranks * acc),
            **training,
        },
        "optimizer": {"lr": 3e-3, "warmup_steps": 0, "min_lr_ratio": 1.0},
        "checkpoint": {"dir": str(ckpt), "interval_steps": 1000},
        # Validation every 2 steps (on files of the corpus): the loss-parallel evaluation sums over -100 targets
        "data": {"val": [str(VAL)]},
        "logging": {"dir": str(folder / "logs"), "eval_interval_steps": 2, "eval_batches": 2},
    }
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(deep_update(TINY, over), sort_keys=False))
    return path


def moe_leg(root: Path, name: str, ranks: int, ep: int, steps: int, ckpt: Path) -> Path:
    """A leg of the tiny Qwen3-MoE (4 experts, top-2, one MoE layer) at `ep` on `ranks` (ep borrows data-parallel
    ranks: the micro-batch stays the reference's per rank)."""
    import json

    from tests.family_configs import tiny

    folder = root / name
    folder.mkdir(parents=True)
    config = root / "moe-config.json"  # one file: a resumed plan names the model its checkpoint was trained with
    config.write_text(json.dumps(tiny("qwen3_moe")))
    plan = yaml.safe_load(leg(root, f"{name}-base", ranks, 1, steps, ckpt).read_text())
    plan["model"] = {"config": str(config)}
    plan["parallel"] = {"sharding": "full_shard", "ep": ep}
    plan["logging"]["dir"] = str(folder / "logs")
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-resume")
    plans = {
        "reference": leg(root, "reference", 2, 1, 6, root / "ref-ckpt"),
        "tp2": leg(root, "tp2", 4, 2, 2, root / "ckpt"),
        "tp1": leg(root, "tp1", 2, 1, 4, root / "ckpt"),
        "tp4": leg(root, "tp4", 4, 4, 6, root / "ckpt"),
        "cp2": leg(root, "cp2", 2, 1, 2, root / "cp-ckpt", {"cp": 2}),
        "cp2x2": leg(root, "cp2x2", 4, 1, 4, root / "cp-ckpt", {"cp": 2, "loss_chunk_tokens": 16}),
        "cp4": leg(
            root,
            "cp4",
            4,
            1,
            6,
            root / "cp-ckpt",
            {"cp": 4, "cp_rotate": "alltoall", "activation_checkpointing": "full"},
        ),  # fmt: skip
        # pp 2 (1F1B, 2 ranks) -> FSDP 2 -> pp 2 x FSDP 2 (interleaved: 4 stages over 2 layers), 4 micro-batches a step
        "pp2": leg(root, "pp2", 2, 1, 2, root / "pp-ckpt", {"pp": 2, "grad_accum_steps": 4}),
        "pp1": leg(root, "pp1", 2, 1, 4, root / "pp-ckpt"),
        "pp2x2": leg(
            root, "pp2x2", 4, 1, 6, root / "pp-ckpt", {"pp": 2, "pp_schedule": "interleaved", "grad_accum_steps": 2}
        ),
        # expert parallelism: ep 2 (2 ranks) -> ep 1 (FSDP 2) -> ep 2 x efsdp 2 (4 ranks), against the MoE's own
        # uninterrupted FSDP run
        "moe-reference": moe_leg(root, "moe-reference", 2, 1, 6, root / "moe-ref-ckpt"),
        "ep2": moe_leg(root, "ep2", 2, 2, 2, root / "ep-ckpt"),
        "ep1": moe_leg(root, "ep1", 2, 1, 4, root / "ep-ckpt"),
        "ep2x2": moe_leg(root, "ep2x2", 4, 2, 6, root / "ep-ckpt"),
    }
    runs = run_engine_plans(list(plans.values()), 4, root, timeout=900)
    for p in plans.values():
        check_ok(runs[p])
    return {**plans, "root": root}


@pytest.mark.parametrize(
    "legs", [("tp2", "tp1", "tp4"), ("cp2", "cp2x2", "cp4"), ("pp2", "pp1", "pp2x2"), ("ep2", "ep1", "ep2x2")]
)
def test_resume_across_degrees_continues_the_loss_curve(chain: dict[str, Path], legs: tuple[str, ...]) -> None:
    reference = chain["moe-reference" if legs[0] == "ep2" else "reference"]
    ref = losses(reference)
    got = {step: v for name in legs for step, v in losses(chain[name]).items()}
    assert sorted(got) == sorted(ref) == list(range(1, 7))  # each leg started where the last one saved
    for step in ref:
        assert abs(ref[step] - got[step]) <= 1e-5, (step, ref, got)
    assert ref[6] < ref[1]
    ref_eval = {r["step"]: r["val_loss"] for r in records(reference, "eval")}
    got_eval = {r["step"]: r["val_loss"] for name in legs for r in records(chain[name], "eval")}
    assert sorted(ref_eval) == sorted(got_eval) == [2, 4, 6]
    for step, v in ref_eval.items():
        assert abs(v - got_eval[step]) <= 1e-5, (step, ref_eval, got_eval)
    # The validation counted every token once: a cp rank sums its part's tokens, not the whole sequence's.
    tokens = {r["val_tokens"] for name in legs for r in records(chain[name], "eval")}
    assert tokens == {r["val_tokens"] for r in records(reference, "eval")}


def test_the_start_event_says_how_the_ring_runs(chain: dict[str, Path]) -> None:
    start = records(chain["cp4"], "start")[0]
    assert start["cp"] == 4 and start["mesh_dims"] == ["shard", "cp"] and start["mesh"] == [1, 4]
    assert "ring attention over cp 4 (head-tail load balance, alltoall rotation)" in start["message"]
    assert records(chain["reference"], "start")[0]["cp"] == 1
    ep = records(chain["ep2x2"], "start")[0]
    assert ep["ep"] == 2 and ep["expert_shard"] == 2 and "ep" not in records(chain["ep1"], "start")[0]
    # every step record says how the router spread its rows: 256 tokens x top-2 over 4 experts, 128 per expert
    steps = records(chain["ep2x2"], "step")
    assert steps and all(r["expert_tokens_mean"] == 128.0 for r in steps)
    assert all(r["expert_tokens_min"] <= 128.0 <= r["expert_tokens_max"] for r in steps)
    assert all(r["expert_imbalance"] == r["expert_tokens_max"] / 128.0 for r in steps)


@pytest.mark.parametrize("kind", ["tp", "pp", "ep"])
def test_export_of_a_tp_or_pp_checkpoint_equals_the_data_parallel_export(chain: dict[str, Path], kind: str) -> None:
    """The last tp checkpoint (saved at tp 4), the last pp one (saved at pp 2 x FSDP 2, interleaved) and the last ep
    one (ep 2 x efsdp 2: experts as DTensors over two meshes) export the data-parallel run's Hugging Face folder
    (the experts in transformers' layout)."""
    from safetensors.torch import load_file

    from llmctl.engine.export import ExportRequest, export_checkpoint

    root = chain["root"]
    folders = {}
    ref_ckpt = root / ("moe-ref-ckpt" if kind == "ep" else "ref-ckpt")
    for name, ckpt in (("dp", ref_ckpt), (kind, root / f"{'' if kind == 'tp' else kind + '-'}ckpt")):
        out = root / f"export-{kind}-{name}"
        export_checkpoint(ExportRequest(checkpoint=ckpt, out=out, dtype="fp32"))
        folders[name] = out
    assert (folders["dp"] / "config.json").read_text() == (folders[kind] / "config.json").read_text()
    a = {k: v for f in sorted(folders["dp"].glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(folders[kind].glob("*.safetensors")) for k, v in load_file(f).items()}
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        # Six AdamW steps amplify the reduction order's 1e-7 gradient differences where a gradient is near 0 (one
        # value in 10^4 moves 1e-5); a misplaced shard would move whole rows by the weights' scale (~2e-2).
        assert torch.allclose(a[name], b[name], atol=1e-4, rtol=0), name
