"""The 2025-26 families from the command line: presets by name and hub id, hub ids from a local Hugging Face cache,
MoE total/active counts, and FLOPs from active parameters in the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.plan import flops
from llmctl.spec import models
from tests.family_configs import tiny

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def fake_cache(root: Path, repo_id: str, config: dict) -> Path:
    """A Hugging Face hub cache holding one repo's config.json, in huggingface_hub's layout."""
    org, name = repo_id.split("/")
    repo = root / f"models--{org}--{name}"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return root


@pytest.mark.parametrize(
    "model,params",
    [
        ("qwen3-8b", 8_190_735_360),
        ("Qwen/Qwen3-8B", 8_190_735_360),
        ("deepseek-v3", 671_026_404_352),
        ("gpt-oss-120b", 116_829_156_672),
        ("gemma-3-27b", 27_009_346_304),
        ("meta-llama/Llama-4-Scout-17B-16E", 107_769_861_120),
    ],
)
def test_presets_by_name_and_hub_id(model, params, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # empty: a preset's hub id never needs the cache
    r = run("estimate-memory", model, "--gpu", "H100-SXM", "--gpus", "8", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["params"] == params  # stderr may note the kernel the engine runs (gpt-oss: eager)


def test_hub_id_from_the_local_cache(monkeypatch, tmp_path):
    cfg = tiny("qwen3", num_hidden_layers=3)
    monkeypatch.setenv("HF_HUB_CACHE", str(fake_cache(tmp_path, "acme/Qwen3-Tiny", cfg)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("estimate-memory", "acme/Qwen3-Tiny", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["params"] == models.from_hf_config(cfg).params
    r = run("plan", "acme/Qwen3-Tiny", "--gpu", "A100-80GB", "--json")
    assert r.exit_code == 0, r.output


def test_missing_hub_id_offline_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("estimate-memory", "acme/Not-There")
    assert r.exit_code == 2
    lines = [x for x in r.output.strip().splitlines() if x.strip()]
    assert "acme/Not-There" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert "Traceback" not in r.output


def test_list_models_shows_total_and_active():
    r = run("estimate-memory", "--list-models")
    assert r.exit_code == 0, r.output
    row = next(x for x in r.output.splitlines() if "qwen3-30b-a3b" in x)
    assert "30,532,122,624" in row and "3,353,032,704" in row


def test_moe_flops_come_from_active_parameters():
    """A token of Qwen3-30B-A3B runs 8 of 128 experts: its FLOPs are those of ~3B parameters, not 30B."""
    spec = models.from_preset("qwen3-30b-a3b")
    per_token = flops.model_flops_per_token(spec, 4096)
    assert 6 * 2.9e9 < per_token - flops.attention_flops_per_token(spec, 4096) < 6 * 3.5e9
    dense = models.from_preset("qwen3-32b")
    assert flops.model_flops_per_token(dense, 4096) > 6 * per_token


def test_sliding_window_layers_do_less_attention_work():
    """Gemma 3's local layers attend to 1024 keys: at 32k tokens its attention FLOPs are far below a model whose
    layers are all global."""
    spec = models.from_preset("gemma-3-27b")
    cfg = dict(spec.hf_config, layer_types=["full_attention"] * spec.num_layers)
    all_global = models.from_hf_config(cfg)
    assert all_global.params == spec.params
    s = 32768
    assert flops.attention_flops_per_token(spec, s) < 0.3 * flops.attention_flops_per_token(all_global, s)
    # At a sequence no longer than the window every layer sees every key.
    assert flops.attention_flops_per_token(spec, 1024) == flops.attention_flops_per_token(all_global, 1024)


# --- the attention kernel the engine will run ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "preset,asked,runs",
    [
        ("gemma-2-9b", "sdpa", "eager"),  # soft-capped attention logits: no SDPA path in transformers
        ("gpt-oss-20b", "flash", "flash"),
        ("gpt-oss-20b", "sdpa", "eager"),  # attention sinks
        ("llama-4-scout", "flash", "sdpa"),  # Llama4PreTrainedModel._supports_flash_attn = False
        ("qwen3-8b", "sdpa", "sdpa"),
        ("qwen3-8b", "eager", "eager"),
    ],
)
def test_estimate_counts_the_kernel_the_engine_runs(preset, asked, runs):
    spec = models.from_preset(preset)
    assert spec.attention_kernel(asked) == runs
    r = run("estimate-memory", preset, "--attention", asked, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["setup"]["attention"] == runs
    assert (f"the engine runs {runs}" in r.stderr) == (runs != asked)
    same = json.loads(run("estimate-memory", preset, "--attention", runs, "--json").stdout)
    assert out["per_gpu_total_bytes"] == same["per_gpu_total_bytes"]


def test_plan_never_picks_a_kernel_the_model_lacks():
    r = run("plan", "gemma-2-9b", "--gpu", "H100-SXM", "--gpus-per-node", "8", "--no-write", "--json", "--top", "50")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    kernels = {c["attention"] for c in out["candidates"]}
    assert "sdpa" not in kernels and kernels <= {"flash", "eager"}, kernels
    r = run("plan", "gemma-2-9b", "--gpu", "H100-SXM", "--gpus-per-node", "8", "--no-write", "--attention", "sdpa")
    assert r.exit_code == 2
    assert "gemma-2-9b (gemma2) has no sdpa path in transformers" in r.output


@pytest.mark.parametrize(
    ("repo_id", "preset"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("Qwen/Qwen3-8B-Base", "qwen3-8b"),
        ("google/gemma-2-9b-it", "gemma-2-9b"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
    ],
)
def test_an_uncached_variant_of_a_preset_plans_as_the_preset(monkeypatch, tmp_path, repo_id, preset):
    """Issue 49: offline, another checkpoint of a preset's architecture (-Instruct, -Base, -it, -chat) resolves to
    the preset with one note, instead of a cache error."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("estimate-memory", repo_id, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["params"] == models.from_preset(preset).params
    assert [x for x in r.stderr.splitlines() if "planned as preset" in x] == [
        f"llmctl: note: {repo_id}: config.json is not cached here; planned as preset {preset} "
        f"({models.preset_entry(preset)['hf_id']}: the same architecture, another checkpoint of it)"
    ]


@pytest.mark.parametrize(
    ("repo_id", "want"),
    [
        ("meta-lama/Llama-3.1-8B", "did you mean: meta-llama/Llama-3.1-8B"),  # a typo of the organisation
        ("unsloth/Llama-3.1-8B-Instruct", "did you mean: "),  # another org's upload: never guessed, suggested
        ("mistralai/Mistral-7B-Instruct-v0.2", "HF_HUB_OFFLINE"),  # v0.2's config differs from v0.1's: not a variant
    ],
)
def test_what_is_not_a_variant_is_refused_with_suggestions(monkeypatch, tmp_path, repo_id, want):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("estimate-memory", repo_id)
    assert r.exit_code == 2 and want in r.output, r.output
    assert "planned as preset" not in r.output and "Traceback" not in r.output
