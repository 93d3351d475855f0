"""Every analytical Hugging Face family (the registry's tiny configs, llmctl.families) through the engine: decoder
blocks found, meta build + materialize reproducing transformers' buffers and init rules (also shard by shard), the
engine's loss equal to transformers' (Gemma 2's final-logit soft-cap included), and 3 training steps on 2 gloo ranks
with FSDP2 full shard, without and with activation checkpointing.

Training runs two ways, in one 2-rank torchrun of tests/engine/family_worker.py (a torchrun costs ~10 s of CPU
here, a plan under one): every (family, checkpointing mode) with the engine's build, parallelize, materialize, loss
and optimizer, plan after plan; then each family once through the engine's entry point (`llmctl.engine.__main__`'s
main, what `torchrun -m llmctl.engine PLAN` runs: plan, spec, data, training loop, metrics) with full checkpointing,
a new process group per plan (tests/engine/engine_runs.py). Both train on a fixed batch, so the loss must fall at
every step; in fp32 on the CPU checkpointing replays the same ops in the same order, so checkpointed losses and
gradient norms equal the plain run's exactly.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.engine.conftest import (
    REPO,
    TINY,
    check_ok,
    deep_update,
    losses,
    plan_runs,
    read_results,
    records,
    torchrun_script,
)
from tests.family_configs import MOE, OTHERS, tiny

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.engine import loss as loss_mod  # noqa: E402
from llmctl.engine.model import Values, base_spec, build_meta_model, fit_attention, materialize, model_spec_for  # noqa: E402
from llmctl.engine.parallelize import odd_dtype_modules  # noqa: E402
from llmctl.errors import InputError  # noqa: E402
from llmctl.families import REGISTRY  # noqa: E402
from llmctl.families.modules import decoder_layers  # noqa: E402
from llmctl.spec.models import from_hf_config  # noqa: E402
from llmctl.spec.planfile import load_plan  # noqa: E402

VOCAB = 300
SENTENCE = "The quick brown fox jumps over. "  # 32 bytes: the period of the token stream is the block length
FAMILIES = list(REGISTRY)
NO_SDPA = ("gemma2", "gpt_oss")  # attention soft-capping / sinks: transformers has no SDPA path for them

# What each family initializes or computes in its own way: the checks below must have seen these names.
SPECIAL = {
    "gemma2": ["model.embed_tokens.embed_scale", "model.norm.weight"],  # sqrt(hidden) buffer; (1 + w) norms at 0
    "gemma3_text": ["model.rotary_emb.sliding_attention_inv_freq", "model.rotary_emb.full_attention_inv_freq"],
    "phi3": ["model.rotary_emb.inv_freq"],  # LongRoPE
    "deepseek_v3": [
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.rotary_emb.inv_freq",  # YaRN
    ],
    "gpt_oss": [
        "model.layers.0.self_attn.sinks",
        "model.layers.0.mlp.router.bias",
        "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.0.mlp.experts.down_proj",
    ],
    "qwen3_moe": ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"],
    "llama4_text": ["model.layers.1.feed_forward.experts.gate_up_proj", "model.rotary_emb.inv_freq"],  # Llama 3 RoPE
}


def family_plan(
    folder: Path, family: str, training: dict[str, Any] | None = None, cfg: dict[str, Any] | None = None
) -> Path:
    """A 2-rank full-shard plan whose model is `family`'s tiny config.json (or `cfg`), on the repeated sentence."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.json"
    config.write_text(json.dumps(cfg if cfg is not None else tiny(family)))
    text = folder / "fixed.txt"
    text.write_text(SENTENCE * 100)
    plan = deep_update(
        TINY,
        {
            "data": {"kind": "text", "paths": [str(text)]},
            "training": {"max_steps": 3, "seq_len": 32, "micro_batch_size": 2, **(training or {})},
            "optimizer": {"lr": 3e-3, "warmup_steps": 0},
            "logging": {"dir": str(folder / "logs"), "interval_steps": 1},
        },
    )
    plan["model"] = {"config": str(config)}  # replaces TINY's preset and its overrides
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def one_process(plan_path: Path) -> torch.nn.Module:
    """The plan's model as the engine builds it (meta, padded vocabulary), materialized in this process."""
    plan = load_plan(plan_path)
    model = build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")
    materialize(model, plan.setup, torch.device("cpu"), Values(plan.training.seed, base_spec(plan.model).vocab_size))
    return model


def hf_model(family: str, **over: Any) -> torch.nn.Module:
    """The family's model (its tiny config, `over` set) built the ordinary way (transformers picks the attention
    kernel), in train mode."""
    cfg = tiny(family, **over)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).train()


# ------------------------------------------------------------------------------------- blocks, buffers, init rules


@pytest.mark.parametrize("family", list(FAMILIES))
def test_materialized_model_has_transformers_buffers_and_init_laws(tmp_path: Path, family: str) -> None:
    """Meta build -> to_empty -> init: every buffer equals a normally constructed model's (RoPE variants, Gemma's
    embed_scale, DeepSeek's e_score_correction_bias); every parameter is finite and follows the same law as the
    normal model's: constants (norms, biases, zero-init) exactly, random draws with the same spread."""
    model = one_process(family_plan(tmp_path, family))
    layers = decoder_layers(model)
    assert len(layers) == from_hf_config(tiny(family)).num_layers
    # The blocks are the modules transformers itself keeps whole (LlamaDecoderLayer, ..., GPT2Block).
    assert all(type(b).__name__ in model._no_split_modules for b in layers), {type(b).__name__ for b in layers}
    attn = model.config._attn_implementation
    assert attn == ("eager" if family in NO_SDPA else "sdpa")

    torch.manual_seed(1)
    ref = transformers.AutoModelForCausalLM.from_config(model.config)
    ref_buffers = dict(ref.named_buffers())
    seen = set()
    for name, b in model.named_buffers():
        r = ref_buffers[name]
        assert b.dtype == r.dtype and torch.equal(b, r), (
            f"{family} buffer {name}: {b.flatten()[:4]} vs {r.flatten()[:4]}"
        )
        seen.add(name)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name].detach()
        p = p.detach()
        assert p.shape == r.shape and p.dtype == r.dtype, name
        assert torch.isfinite(p).all(), f"{family} {name}: not finite"
        if (r == r.flatten()[0]).all():  # a constant init (ones, zeros): reproduced exactly
            assert torch.equal(p, r), f"{family} {name}: {p.flatten()[:4]} vs constant {r.flatten()[0]}"
        elif p.numel() >= 256:  # a random init: the same spread (normal(0, initializer_range) here)
            assert abs(p.std().item() - r.std().item()) < 0.2 * r.std().item(), (name, p.std().item(), r.std().item())
            assert abs(p.mean().item()) < 0.2 * r.std().item(), (name, p.mean().item())
        else:  # a few random values (gpt-oss sinks and router bias: 4 heads / experts)
            assert 0 < p.std().item() < 3 * r.std().item() + 1e-6 and p.abs().max() < 10 * r.std().item(), name
        seen.add(name)
    assert set(SPECIAL.get(family, [])) <= seen


def test_gemma_and_deepseek_special_values() -> None:
    """The values behind the buffers above, stated once: Gemma's embedding scale is sqrt(hidden) and Gemma 3's two
    RoPE tables differ (local theta 1e4, global theta 1e6 / linear 8); DeepSeek's correction bias starts at zero."""
    g2 = hf_model("gemma2")
    assert float(g2.model.embed_tokens.embed_scale) == math.sqrt(64)
    g3 = hf_model("gemma3_text").model.rotary_emb
    assert not torch.equal(g3.sliding_attention_inv_freq, g3.full_attention_inv_freq)
    ds = hf_model("deepseek_v3").model.layers[1].mlp.gate
    assert torch.count_nonzero(ds.e_score_correction_bias) == 0 and ds.weight.dtype == torch.float32


# ------------------------------------------------------------------------------------------------------- the loss


def _engine_losses(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(whole, chunked) engine loss of next-token prediction on `ids`, as the engine feeds it (inputs and targets
    shifted by one)."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    whole = float(loss_mod.whole_loss(model, inputs, targets, VOCAB).detach())
    loss_mod.install_loss_forward(model, "chunked", VOCAB, 24)
    chunked = float(model(input_ids=inputs, labels=targets).detach())
    return whole, chunked


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_loss_equals_transformers_loss(family: str) -> None:
    """Whole and chunked loss equal model(input_ids, labels=input_ids).loss for every family (the chunked loss
    computes the logits itself from the final hidden states and the LM head)."""
    # Without GPT-2's default dropout: each forward draws its own masks, so the losses would differ by them.
    model = hf_model(family, **({"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0} if family == "gpt2" else {}))
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf = float(model(input_ids=ids, labels=ids).loss)
        whole, chunked = _engine_losses(model, ids)
    assert math.isfinite(hf)
    assert whole == pytest.approx(hf, abs=1e-5, rel=0)
    assert chunked == pytest.approx(hf, abs=1e-5, rel=0)


def test_gemma2_final_logit_softcapping_is_applied_like_transformers() -> None:
    """With logits large enough for the cap to matter (embeddings, tied to the head, scaled by 100: logits of
    about +-16 against a cap of 30), the engine's whole and chunked losses equal transformers' loss, and the
    uncapped loss does not."""
    model = hf_model("gemma2")
    assert model.config.final_logit_softcapping == 30.0 and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.lm_head.weight.mul_(100)
    ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        hf = float(model(input_ids=ids, labels=ids).loss)
        hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state
        capped = float(loss_mod.chunked_loss(hidden, model.lm_head.weight, None, ids[:, 1:], VOCAB, 24, 30.0))
        uncapped = float(loss_mod.chunked_loss(hidden, model.lm_head.weight, None, ids[:, 1:], VOCAB, 24, None))
        whole, chunked = _engine_losses(model, ids)
    assert abs(uncapped - hf) > 0.1, "the cap does not change the loss: the test would not see it missing"
    assert capped == pytest.approx(hf, abs=1e-5, rel=0)
    assert whole == pytest.approx(hf, abs=1e-5, rel=0)
    assert chunked == pytest.approx(hf, abs=1e-5, rel=0)


def test_chunked_loss_refuses_logit_scaling_it_does_not_apply() -> None:
    from llmctl.errors import SpecError

    model = hf_model("qwen3")
    model.config.logit_scale = 0.0625  # as Cohere's config says
    with pytest.raises(SpecError, match="logit_scale"):
        loss_mod.install_loss_forward(model, "chunked", VOCAB, 24)


# ------------------------------------------------------------------------------------------- attention, FSDP groups


def test_attention_falls_back_where_the_model_has_no_such_kernel() -> None:
    assert fit_attention("sdpa", "auto", "Gemma2ForCausalLM", False, True) == "eager"
    assert fit_attention("sdpa", "eager", "Gemma2ForCausalLM", False, True) == "eager"  # dry-start asks for sdpa
    assert fit_attention("flash_attention_2", "auto", "X", True, False) == "sdpa"
    assert fit_attention("flash_attention_2", "auto", "X", False, False) == "eager"
    assert fit_attention("sdpa", "auto", "LlamaForCausalLM", True, True) == "sdpa"
    with pytest.raises(InputError, match="Gemma2ForCausalLM has no SDPA path"):
        fit_attention("sdpa", "sdpa", "Gemma2ForCausalLM", False, True)
    with pytest.raises(InputError, match="no flash-attention path"):
        fit_attention("flash_attention_2", "flash", "X", True, False)


def test_fp32_router_of_a_bf16_deepseek_is_its_own_fsdp_group() -> None:
    """transformers keeps DeepSeek-V3's router weight in fp32 in a bf16 model; FSDP2 refuses a group of mixed
    dtypes, so the router is sharded on its own (the dense layer and the other families have one dtype)."""
    cfg = tiny("deepseek_v3")
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    dense, moe = model.model.layers
    assert odd_dtype_modules(dense) == []
    assert odd_dtype_modules(moe) == [moe.mlp.gate]


# ---------------------------------------------------------------------------------------------------- training


def modes(family: str) -> list[str]:
    """No checkpointing, full, and selective for the MoE and MLA families (grouped-mm / index ops under the
    op-level policy)."""
    return ["none", "full"] + (["selective"] if family in MOE else [])


EXTRA = {  # (family, name): training section; compared with the family's plain run
    ("deepseek_v3", "bf16"): {"precision": "bf16", "activation_checkpointing": "selective"},  # fp32 router in bf16
    ("gemma2", "chunked"): {"loss_chunk_tokens": 24, "activation_checkpointing": "full"},  # soft-cap in the chunks
}


# A type outside the analytical families (tests/family_configs.py: granite's embedding/residual multipliers): the
# engine's spec of it is measured on fake tensors (llmctl.measure.fake, installed by the engine's __main__).
GRANITE = {**OTHERS[0], "vocab_size": VOCAB, "bos_token_id": 256, "eos_token_id": 257}


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank torchrun: every (family, mode) plan through the worker ("trained": (family, mode) -> its result),
    then every family's plan and granite's, with full checkpointing, through the engine's entry point ("cli": family
    -> (plan, its run as a CompletedProcess), "cache": the measurement cache of the launch)."""
    root = tmp_path_factory.mktemp("families")
    plans = {
        (fam, mode): family_plan(root / f"{fam}-{mode}", fam, {"activation_checkpointing": mode})
        for fam in FAMILIES
        for mode in modes(fam)
    }
    for (fam, name), training in EXTRA.items():
        plans[(fam, name)] = family_plan(root / f"{fam}-{name}", fam, training)
    full = {"activation_checkpointing": "full"}
    cli = {fam: family_plan(root / f"{fam}-cli", fam, full) for fam in FAMILIES}
    cli["granite"] = family_plan(root / "granite-cli", "granite", full, cfg=GRANITE)
    out, cache = root / "results.json", root / "measured"
    worker = REPO / "tests" / "engine" / "family_worker.py"
    args = [str(out), *map(str, plans.values()), "--engine", *map(str, cli.values())]
    proc = torchrun_script(worker, args, 2, root, {"LLMCTL_CACHE_DIR": str(cache)}, timeout=900)
    got = read_results(out)
    trained = {key: got.get(str(path), {"error": f"not run\n{proc.stderr[-8000:]}"}) for key, path in plans.items()}
    runs = plan_runs(proc, got, list(cli.values()))
    return {"trained": trained, "cli": {fam: (path, runs[path]) for fam, path in cli.items()}, "cache": cache}


@pytest.fixture(scope="module")
def trained(launch: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(family, mode) -> the worker's result for every family and mode."""
    return launch["trained"]


def result(trained: dict, key: tuple[str, str]) -> dict[str, Any]:
    got = trained[key]
    assert "error" not in got, f"{key}: {got.get('error')}"
    return got


def _finite_and_falling(losses: list[float], norms: list[float]) -> None:
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses + norms), (losses, norms)
    assert losses[0] > losses[1] > losses[2], losses


@pytest.mark.dist
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_with_and_without_checkpointing(trained: dict, family: str) -> None:
    """FSDP2 full shard on 2 gloo ranks, 3 steps on a fixed batch: the shards start as exactly the one-process
    model; the loss is finite and falls; checkpointing (full, selective) changes no number."""
    ref = result(trained, (family, "none"))
    assert ref["init_equal"] is True
    assert ref["attention"] == ("eager" if family in NO_SDPA else "sdpa")
    _finite_and_falling(ref["losses"], ref["grad_norms"])
    for mode in modes(family)[1:]:
        got = result(trained, (family, mode))
        assert got["losses"] == ref["losses"] and got["grad_norms"] == ref["grad_norms"], mode


@pytest.mark.dist
def test_bf16_deepseek_trains_with_its_fp32_router(trained: dict) -> None:
    """Pure bf16 (the model built in bf16, transformers keeping the router in fp32) with selective checkpointing:
    FSDP2 used to refuse the MoE layer ("FSDP expects uniform original parameter dtype")."""
    got, ref = result(trained, ("deepseek_v3", "bf16")), result(trained, ("deepseek_v3", "none"))
    assert got["init_equal"] is True
    _finite_and_falling(got["losses"], got["grad_norms"])
    assert got["losses"] == pytest.approx(ref["losses"], abs=0.05)  # bf16 rounding, not a different model


@pytest.mark.dist
def test_gemma2_chunked_loss_trains_like_the_whole_loss(trained: dict) -> None:
    """The chunked loss (its own LM head and soft-cap) under FSDP2 and checkpointing: the same losses and gradient
    norms as the whole loss, within float rounding."""
    got, ref = result(trained, ("gemma2", "chunked")), result(trained, ("gemma2", "none"))
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], abs=1e-5, rel=0)


def _trained_three_fully_checkpointed_steps(plan: Path, proc: subprocess.CompletedProcess[str]) -> None:
    """The run finished on 2 FSDP2 ranks with full checkpointing; its loss is finite and falls over 3 steps."""
    check_ok(proc)
    start = records(plan, "start")[0]
    assert start["fsdp2"] is True and start["mesh"] == [2] and start["vocab_size"] == 320
    assert start["checkpointing"] == "full"
    loss = losses(plan)
    assert sorted(loss) == [1, 2, 3]
    _finite_and_falling([loss[1], loss[2], loss[3]], [r["grad_norm"] for r in records(plan, "step")])


@pytest.mark.dist
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_through_the_engine_cli(launch: dict[str, Any], family: str) -> None:
    """The engine's entry point on 2 ranks with the family's config.json and full checkpointing: the plan, spec,
    build, FSDP2 and the training loop end to end; the repeated sentence is a fixed batch. The families without an
    SDPA path say that they fall back to eager (in this run's log alone)."""
    plan, proc = launch["cli"][family]
    _trained_three_fully_checkpointed_steps(plan, proc)
    if family in NO_SDPA:
        assert "has no sdpa path in transformers, using eager" in proc.stderr
    else:
        assert "using eager" not in proc.stderr


@pytest.mark.dist
def test_a_measured_type_trains_through_the_engine_cli(launch: dict[str, Any]) -> None:
    """granite through the engine's entry point on 2 ranks, FSDP2 full shard with full checkpointing: the ranks
    measure the config (cached in $LLMCTL_CACHE_DIR), build, shard and train 3 steps; the loss is finite and falls
    on the fixed batch."""
    assert GRANITE["model_type"] == "granite"
    plan, proc = launch["cli"]["granite"]
    _trained_three_fully_checkpointed_steps(plan, proc)
    # One measurement (the plan's config): the padded vocabulary is derived from it, not measured again; the
    # analytical families of the launch measure nothing.
    assert len(list(launch["cache"].glob("*.json"))) == 1, sorted(launch["cache"].iterdir())
