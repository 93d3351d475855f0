"""Meta-device build + materialization of only the local shard: random init with the model's own rules, identical
on every world size; local Hugging Face weights read slice by slice; one-line errors for bad weight folders.

The sharded cases run tests/engine/shard_worker.py, which plays rank R of a world of W under a fake process group
(exactly the engine's setup), so each rank's shard is compared with the rows of a one-process model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from llmctl.engine.materialize import BLOCK_VALUES, Slot, WeightFiles, draw_rows
from llmctl.engine.model import Values, base_spec, build_meta_model, materialize, model_spec_for
from llmctl.errors import SpecError
from llmctl.spec.planfile import load_plan
from tests.engine.conftest import REPO, write_plan

LLAMA_300 = {"vocab_size": 300}  # padded to 320 by the engine: 20 rows that no file has
GPT2 = {"preset": "gpt2-tiny", "overrides": {"n_layer": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}


def one_process(plan_path: Path) -> torch.nn.Module:
    """The plan's model materialized in this process without a process group (a world of one: plain tensors)."""
    plan = load_plan(plan_path)
    model = build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")
    weights = WeightFiles.scan(plan.model.weights) if plan.model.weights else None
    materialize(
        model, plan.setup, torch.device("cpu"), Values(plan.training.seed, base_spec(plan.model).vocab_size, weights)
    )
    return model


def shards(plan_path: Path, world: int, ranks: list[int], tmp: Path) -> dict[int, dict[str, Any]]:
    """Each rank's shards, from one shard_worker process per rank (run side by side)."""
    worker = str(REPO / "tests" / "engine" / "shard_worker.py")
    procs = {}
    for r in ranks:
        out = tmp / f"shards-{world}-{r}.pt"
        argv = [sys.executable, worker, str(plan_path), str(out), str(world), str(r)]
        procs[r] = (out, subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True))
    got: dict[int, dict[str, Any]] = {}
    for out, proc in procs.values():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        got.update(torch.load(out, weights_only=False))
    return got


def assert_shards_are_rows(model: torch.nn.Module, got: dict[int, dict[str, Any]]) -> None:
    """Every played rank's local tensor is exactly its rows of the one-process parameter (and a rank past the
    first holds rows past the first: the offsets really differ)."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name, p in params.items():
        for rank, held in got.items():
            s = held[name]
            full = p.detach()
            want = full[s["offset"] : s["offset"] + s["rows"]] if full.ndim else full
            assert torch.equal(s["local"], want), f"rank {rank} {name}: shard differs from the one-process rows"
    assert any(
        held["model.norm.weight" if "model.norm.weight" in held else "transformer.ln_f.weight"]["offset"] > 0
        for held in got.values()
    )
    for rank, held in got.items():
        for name, b in held["__buffers__"].items():
            assert torch.equal(b, buffers[name]), f"rank {rank} buffer {name} differs"


# ------------------------------------------------------------------------------------------------ counter-based draws


@pytest.mark.parametrize("world", [1, 2, 3, 7, 64])
def test_draws_of_a_shard_are_the_rows_of_the_whole(world: int) -> None:
    rows, cols = 1000, 300  # 218 rows per block: shard edges cut blocks for most world sizes
    whole = torch.empty(rows, cols)
    draw_rows(Slot(["w"], None, (rows, cols), 0, rows, whole), 7, "normal", 0.0, 0.02)
    chunk = -(-rows // world)
    parts = []
    for r in range(world):
        lo = min(rows, r * chunk)
        n = min(rows, lo + chunk) - lo
        t = torch.empty(n, cols)
        draw_rows(Slot(["w"], None, (rows, cols), lo, n, t), 7, "normal", 0.0, 0.02)
        parts.append(t)
    assert torch.equal(torch.cat(parts), whole)
    assert abs(whole.std().item() - 0.02) < 0.001 and abs(whole.mean().item()) < 0.001
    other = torch.empty(rows, cols)
    draw_rows(Slot(["v"], None, (rows, cols), 0, rows, other), 7, "normal", 0.0, 0.02)
    assert not torch.equal(other, whole), "two parameters must not get the same draws"
    assert BLOCK_VALUES // cols < rows  # several blocks were really involved


def test_draws_into_bf16_are_the_float32_draws_rounded() -> None:
    f32 = torch.empty(50, 40)
    bf = torch.empty(50, 40, dtype=torch.bfloat16)
    draw_rows(Slot(["w"], None, (50, 40), 0, 50, f32), 1, "uniform", -1.0, 1.0)
    draw_rows(Slot(["w"], None, (50, 40), 0, 50, bf), 1, "uniform", -1.0, 1.0)
    assert torch.equal(bf, f32.bfloat16()) and f32.min() >= -1 and f32.max() <= 1


# ----------------------------------------------------------------------------------------- the model's own init rules


def test_llama_random_init_follows_transformers_rules(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = one_process(write_plan(tmp_path, {"model": {"overrides": LLAMA_300}}))
    std = model.config.initializer_range
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # Linear and Embedding: normal(0, initializer_range)
            assert abs(p.std().item() - std) < 0.15 * std, (name, p.std().item())
    # RoPE's inv_freq is a buffer computed at construction: recomputed, not left as to_empty's garbage.
    ref = AutoModelForCausalLM.from_config(model.config)
    for name, b in ref.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], b), name
    assert model.get_input_embeddings().weight.shape[0] == 320  # 300 padded to a multiple of 64


def test_gpt2_init_keeps_ties_and_scales_residual_projections(tmp_path: Path) -> None:
    model = one_process(write_plan(tmp_path, {"model": GPT2}))
    assert model.lm_head.weight is model.transformer.wte.weight, "tied embeddings untied by to_empty"
    n_layer = model.config.n_layer
    std = model.config.initializer_range
    for block in model.transformer.h:
        # GPT-2's own rule: residual projections get initializer_range / sqrt(2 * n_layer).
        assert abs(block.attn.c_proj.weight.std().item() - std / math.sqrt(2 * n_layer)) < 0.15 * std / 2
        assert abs(block.mlp.c_fc.weight.std().item() - std) < 0.15 * std
        assert torch.equal(block.attn.c_attn.bias, torch.zeros_like(block.attn.c_attn.bias))
        assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))


def test_embedding_padding_row_is_zero_on_the_rank_that_holds_it(tmp_path: Path) -> None:
    plan = write_plan(
        tmp_path, {"model": {"overrides": {**LLAMA_300, "pad_token_id": 299}}, "hardware": {"nproc_per_node": 4}}
    )
    model = one_process(plan)
    assert torch.count_nonzero(model.get_input_embeddings().weight[299]) == 0
    got = shards(plan, 4, [3], tmp_path)  # rows 240-319: the padding row is rank 3's
    assert torch.count_nonzero(got[3]["model.embed_tokens.weight"]["local"][299 - 240]) == 0
    assert_shards_are_rows(model, got)


# -------------------------------------------------------------------------------- the same model on every world size


@pytest.mark.parametrize(
    ("model", "hardware", "parallel", "world", "ranks"),
    [
        ({"overrides": LLAMA_300}, {"nproc_per_node": 4}, {"sharding": "full_shard"}, 4, [0, 3]),
        # (0, 2) and (1, 1) of the (replicate, shard) mesh: a short last shard (320 = 107 + 107 + 106) and a replica.
        ({"overrides": LLAMA_300}, {"nodes": 2, "nproc_per_node": 3}, {"sharding": "hybrid_shard"}, 6, [2, 4]),
        (GPT2, {"nproc_per_node": 3}, {"sharding": "full_shard"}, 3, [1, 2]),
    ],
    ids=["llama-full-4", "llama-hybrid-2x3", "gpt2-full-3"],
)
def test_every_rank_holds_exactly_its_rows_of_the_one_process_model(
    tmp_path: Path,
    model: dict[str, Any],
    hardware: dict[str, Any],
    parallel: dict[str, Any],
    world: int,
    ranks: list[int],
) -> None:
    plan = write_plan(tmp_path, {"model": model, "hardware": hardware, "parallel": parallel})
    assert_shards_are_rows(one_process(plan), shards(plan, world, ranks, tmp_path))


# ---------------------------------------------------------------------------------------------- local HF weights


def save_tiny_llama(folder: Path, vocab: int = 300, shard_size: str = "60KB") -> dict[str, torch.Tensor]:
    """A random tiny Llama saved with save_pretrained, sharded into several safetensors files with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    m = LlamaForCausalLM(cfg)
    m.save_pretrained(folder, max_shard_size=shard_size)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def weights_plan(tmp: Path, weights: Path, **over: Any) -> Path:
    return write_plan(tmp, {"model": {"preset": None, "overrides": {}, "weights": str(weights)}, **over})


def test_weights_are_read_slice_by_slice_into_every_rank(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    want = save_tiny_llama(hf)
    assert len(list(hf.glob("*.safetensors"))) >= 2 and (hf / "model.safetensors.index.json").is_file()
    plan = weights_plan(tmp_path, hf, hardware={"nproc_per_node": 4})
    model = one_process(plan)
    for name, p in model.named_parameters():
        w = want[name]
        assert torch.equal(p[: w.shape[0]], w), name
        if p.shape[0] > w.shape[0]:  # the padded vocabulary rows: zero
            assert p.shape[0] == 320 and torch.count_nonzero(p[w.shape[0] :]) == 0, name
    assert_shards_are_rows(model, shards(plan, 4, [0, 3], tmp_path))


def test_tied_gpt2_weights_load_into_one_tensor(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = tmp_path / "gpt2"
    torch.manual_seed(2)
    ref = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128))
    ref.save_pretrained(hf)
    model = one_process(weights_plan(tmp_path, hf))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight[:300], ref.transformer.wte.weight)
    assert torch.equal(model.transformer.h[1].attn.c_proj.weight, ref.transformer.h[1].attn.c_proj.weight)


def _error(plan: Path) -> str:
    with pytest.raises(SpecError) as e:
        one_process(plan)
    line = str(e.value)
    assert "\n" not in line
    return line


def test_weights_errors_are_one_line_naming_the_problem(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    save_tiny_llama(hf, shard_size="10GB")  # one file: model.safetensors
    # A folder with only PyTorch pickles: say so and how to convert.
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text((hf / "config.json").read_text())
    (bins / "pytorch_model.bin").write_bytes(b"x")
    msg = _error(weights_plan(tmp_path / "a", bins))
    assert "pytorch_model.bin" in msg and "safetensors" in msg and "save_pretrained" in msg
    # A config that disagrees with the weights: the tensor and both shapes are named.
    msg = _error(
        weights_plan(
            tmp_path / "b", hf, model={"preset": None, "weights": str(hf), "overrides": {"intermediate_size": 176}}
        )
    )
    assert "mlp.down_proj.weight" in msg or "mlp.gate_proj.weight" in msg
    assert "[64, 172]" in msg or "[172, 64]" in msg
    # A missing tensor.
    tensors = load_file(hf / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.1.mlp.up_proj.weight" in _error(weights_plan(tmp_path / "c", hf))
    # A damaged file (truncated).
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = _error(weights_plan(tmp_path / "d", hf))
    assert "model.safetensors" in msg
    # No weights at all.
    (hf / "model.safetensors").unlink()
    assert "no *.safetensors" in _error(weights_plan(tmp_path / "e", hf))


def test_a_missing_weights_folder_is_exit_2_from_the_engine(tmp_path: Path) -> None:
    from tests.engine.conftest import engine_env

    hf = tmp_path / "hf"
    save_tiny_llama(hf)
    plan = weights_plan(tmp_path, hf, hardware={"nproc_per_node": 1})
    (hf / "model-00001-of-00003.safetensors").unlink(missing_ok=True)
    idx = json.loads((hf / "model.safetensors.index.json").read_text())
    gone = sorted(set(idx["weight_map"].values()))[0]
    (hf / gone).unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "llmctl.engine", str(plan)],
        cwd=REPO,
        env=engine_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("llmctl: error:")]
    assert len(errors) == 1 and gone in errors[0] and "Traceback" not in proc.stderr
