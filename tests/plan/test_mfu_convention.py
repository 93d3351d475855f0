"""MFU on the FLOPs the kernels run (issue 48): causal attention counted half in `mfu` (the planner's, plan.yaml's and
the engine's alike, so a measurement is compared with a prediction of the same convention), the PaLM / torchtitan
figure (attention whole) kept beside as `mfu_palm` for comparing with published MFU."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.engine.metrics import ThroughputModel
from llmctl.plan import flops as fl
from llmctl.spec.models import resolve_model

L8B = resolve_model("llama-3.1-8b")
PEAK = 989.5


@pytest.mark.parametrize("seq", [2048, 8192, 131072])
def test_causal_mfu_is_below_palm_by_the_attention_half(seq: int) -> None:
    n6, attn = 6 * fl.matmul_params(L8B), fl.attention_flops_per_token(L8B, seq)
    causal, palm = fl.mfu(L8B, seq, 1000.0, PEAK), fl.mfu(L8B, seq, 1000.0, PEAK, causal=False)
    assert palm == pytest.approx((n6 + attn) * 1000 / 1e12 / PEAK)
    assert causal == pytest.approx((n6 + attn // 2) * 1000 / 1e12 / PEAK)
    # the gap is half the attention's share of PaLM's count: larger with longer sequences
    assert 1 - causal / palm == pytest.approx(attn / 2 / (n6 + attn))
    if seq == 131072:
        assert palm / causal > 1.6  # 128k: attention is most of PaLM's count


def test_engine_and_planner_count_the_same_mfu() -> None:
    tput = ThroughputModel.for_run(L8B, 8192, 8 * 8192, 8, "none", PEAK)
    got = tput.measure(step_time_s=1.0)
    per_gpu = 8 * 8192 / 8
    assert got["mfu"] == pytest.approx(fl.mfu(L8B, 8192, per_gpu, PEAK))
    assert got["mfu_palm"] == pytest.approx(fl.mfu(L8B, 8192, per_gpu, PEAK, causal=False))
    assert got["mfu"] < got["mfu_palm"]


def test_plan_reports_both_conventions_and_names_them(tmp_path) -> None:
    args = ["plan", "llama-3.1-8b", "--gpu", "H100", "--gpus", "8", "--seq-len", "8k"]
    r = CliRunner().invoke(app, [*args, "--json", "-o", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)  # stderr says where the run folder is (beside the plan)
    assert d["mfu_convention"] == {"mfu": fl.CAUSAL_MFU, "mfu_palm": fl.PALM_MFU}
    c = d["chosen"]
    assert c["mfu"] < c["mfu_palm"]
    assert all(x["mfu"] < x["mfu_palm"] for x in d["candidates"])
    plan_text = (tmp_path / "p.yaml").read_text()
    assert f"mfu: {round(c['mfu'], 4)}" in plan_text and f"mfu_palm: {round(c['mfu_palm'], 4)}" in plan_text
    r = CliRunner().invoke(app, [*args, "--no-write"])
    assert r.exit_code == 0
    flat = " ".join(r.output.split())
    assert f"MFU {c['mfu']:.1%} with causal attention counted half" in flat
    assert f"{c['mfu_palm']:.1%} counted whole as PaLM" in flat
