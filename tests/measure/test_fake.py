"""Measuring causal LMs on fake tensors (llmctl.measure.fake, llmctl.measure.forward, llmctl.measure.hf).

The method is validated against real tensors: a real forward of a tiny Llama, with the same hooks and storages
told apart by data_ptr, saves exactly the bytes the fake forward reports, layer by layer, in fp32/bf16 x
sdpa/eager x no/full checkpointing. Then measure_config is run on architectures llmctl has no analytical model for.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from llmctl.errors import SpecError, describe  # noqa: E402
from llmctl.families.modules import decoder_layers  # noqa: E402
from llmctl.measure import fake as fm  # noqa: E402
from llmctl.measure import hf  # noqa: E402
from llmctl.measure.forward import saved_bytes, to_fake  # noqa: E402
from llmctl.measure.saved import storage_key  # noqa: E402
from tests.family_configs import KINDS, OTHERS, SMALL, TOKENS  # noqa: E402

LLAMA = {"model_type": "llama", **SMALL, "num_hidden_layers": 3, "tie_word_embeddings": False}
# GPT-2 with learned positions (256 of them: measured at 64/128/256 tokens) and its default 0.1 dropout.
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 256, "n_positions": 256, **TOKENS}


def build(cfg: dict, dtype=torch.float32, attention: str = "sdpa", device: str | None = None):
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)


def fake(cfg: dict, dtype=torch.float32, attention: str = "sdpa"):
    model = build(cfg, dtype, attention, device="meta")
    mode = FakeTensorMode()
    to_fake(model, mode)
    return model, mode


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    return fm.measure_config(LLAMA, cache_dir=tmp_path_factory.mktemp("cache"))


# --- the method against real tensors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fake_forward_saves_what_a_real_forward_saves(dtype, attention):
    b, s, h = 2, 40, LLAMA["hidden_size"]
    act_bytes = torch.finfo(dtype).bits // 8
    for ckpt in ("none", "full"):
        real = build(LLAMA, dtype, attention)
        by_data_ptr = saved_bytes(real, real.model.layers, b, s, ckpt, key=lambda t: t.untyped_storage().data_ptr())
        model, mode = fake(LLAMA, dtype, attention)
        measured = saved_bytes(model, model.model.layers, b, s, ckpt, mode)
        assert measured == by_data_ptr, ckpt
        assert len(set(measured[0])) == 1 or ckpt == "full"  # every layer the same
    # Fully checkpointed, a layer keeps its input alive: b*s*h activations. The last layer's output is saved by the
    # final norm; in bf16 as the norm's fp32 copy, which the head owns.
    assert measured[0][0] == b * s * h * act_bytes
    assert measured[0][-1] == (b * s * h * act_bytes if act_bytes == 4 else 0)


def test_storage_key_identifies_a_storage_across_views():
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(8, 64)
        y = torch.empty(8, 64)
    assert storage_key(x) == storage_key(x[:2]) == storage_key(x.view(4, 128)) == storage_key(x.t())
    assert storage_key(x) != storage_key(y)
    # The shared input of q/k/v (and of gate/up) is saved three (two) times but counted once: without the
    # storage key, counting each saved tensor object, a layer would look larger.
    model, mode = fake(LLAMA)
    per_object = saved_bytes(model, model.model.layers, 1, 32, "none", mode, key=id)
    per_storage = saved_bytes(model, model.model.layers, 1, 32, "none", mode)
    assert per_storage[0][1] < per_object[0][1]


def test_saved_bytes_grow_linearly_with_the_micro_batch():
    model, mode = fake(LLAMA, attention="eager")
    one = saved_bytes(model, model.model.layers, 1, 64, "none", mode)
    two = saved_bytes(model, model.model.layers, 2, 64, "none", mode)
    assert two[0] == [2 * x for x in one[0]]


def test_llama_fit(llama):
    h, heads = LLAMA["hidden_size"], LLAMA["num_attention_heads"]
    assert "fit_error" not in llama
    assert llama["attention_used"] == {"sdpa": "sdpa", "eager": "eager"}
    assert set(llama["saved"]) == {f"{a}/{t}/{c}" for a in (4, 2) for t in ("sdpa", "eager") for c in ("none", "full")}
    assert [k["kind"] for k in llama["layers"]] == ["LlamaDecoderLayer"]
    assert llama["saved"]["4/sdpa/full"]["LlamaDecoderLayer"] == [h * 4, 0]
    assert llama["saved"]["2/sdpa/full"]["LlamaDecoderLayer"] == [h * 2, 0]
    # sdpa keeps no s*s tensor; eager keeps the fp32 softmax (and its bf16 copy in bf16).
    assert llama["saved"]["4/sdpa/none"]["LlamaDecoderLayer"][1] == 0
    assert llama["saved"]["4/eager/none"]["LlamaDecoderLayer"][1] == heads * 4
    assert llama["saved"]["2/eager/none"]["LlamaDecoderLayer"][1] == heads * (4 + 2)
    # The fit reproduces the measurement at a length it was not fit on.
    model, mode = fake(LLAMA, attention="eager")
    per_layer, _ = saved_bytes(model, model.model.layers, 1, 384, "none", mode)
    a, c = llama["saved"]["4/eager/none"]["LlamaDecoderLayer"]
    assert per_layer[0] == a * 384 + c * 384 * 384
    json.dumps(llama)  # plain data


def test_parameter_counts_of_llama(llama):
    h, v, inter, layers = LLAMA["hidden_size"], LLAMA["vocab_size"], LLAMA["intermediate_size"], 3
    kv = h // LLAMA["num_attention_heads"] * LLAMA["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter + 2 * h
    assert llama["layers"][0] | {"indices": None} == {
        "kind": "LlamaDecoderLayer",
        "params": per_layer,
        "count": layers,
        "indices": None,
        "matmul_params": per_layer - 2 * h,
        "active_params": per_layer,  # no experts
        "active_matmul_params": per_layer - 2 * h,
    }
    assert llama["embedding_params"] == v * h
    assert llama["head_params"] == v * h + h  # untied lm_head and the final norm
    assert llama["total_params"] == layers * per_layer + 2 * v * h + h


def test_a_shorter_model_saves_what_the_full_model_saves_per_layer():
    # cohere2 with 8 layers: sliding at 0-2 and 4-6, global at 3 and 7. Activations are measured on the first 5
    # (every kind, then one more layer), layer_types cut to match.
    cfg = {**OTHERS[1], "num_hidden_layers": 8, "sliding_window": 32}  # a window shorter than the 64 tokens
    config = hf.hf_config(cfg, "cohere2")
    full = hf.build(config, "cohere2", "bfloat16", "sdpa")
    signatures, lists = hf.layer_table(full, config, decoder_layers(full))
    assert lists == ["layer_types"]
    short, used = fm._short_model(config, "cohere2", "bfloat16", "sdpa", 5, signatures, lists)
    assert used == "sdpa" and len(short.model.layers) == 5 and short.config.layer_types[3] == "full_attention"
    modes = [FakeTensorMode(), FakeTensorMode()]
    for model, mode in zip((full, short), modes):
        to_fake(model, mode)
    for ckpt in ("none", "full"):
        (full_layers, full_head), (short_layers, short_head) = (
            saved_bytes(model, model.model.layers, 1, 64, ckpt, mode) for model, mode in zip((full, short), modes)
        )
        assert short_layers[:4] == full_layers[:4] and short_head == full_head, ckpt
        # The kinds differ (the sliding layers' mask, RoPE only there), except when all a layer keeps is its input.
        assert (short_layers[0] != short_layers[3]) == (ckpt == "none")


# --- other architectures, cache hits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", OTHERS, ids=[c["model_type"] for c in OTHERS])
def test_measures_architectures_without_an_analytical_model(cfg, measured_others, tmp_path, monkeypatch):
    """Each config is measured once for the session (tests/conftest.py: by its first `llmctl estimate`, through
    measure_config on one cache folder); here what the measurement returned, and the one file measure_config wrote."""
    result = measured_others["measured"][cfg["model_type"]]
    model = build(cfg, device="meta")
    assert result["total_params"] == sum(p.numel() for p in model.parameters())
    in_layers = sum(k["params"] * k["count"] for k in result["layers"])
    assert result["embedding_params"] + result["head_params"] + in_layers == result["total_params"]
    assert {k["kind"]: k["indices"] for k in result["layers"]} == KINDS[cfg["model_type"]]
    assert result["model_type"] == cfg["model_type"]
    for key, kinds in result["saved"].items():
        assert set(kinds) == {k["kind"] for k in result["layers"]}, key
        assert all(a > 0 for a, _ in kinds.values()) or key.endswith("/full"), key
    assert "fit_error" not in result

    shared = measured_others["cache"] / f"{result['config_hash']}.json"
    assert json.loads(shared.read_text()) == result
    assert measured_others["runs"][cfg["model_type"]][2] == {shared.name}  # no temporary file left

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    path = tmp_path / shared.name  # a copy: the refresh below rewrites it
    shutil.copyfile(shared, path)
    monkeypatch.setattr(fm, "_measure", no_measuring)
    assert fm.measure_config(cfg, cache_dir=tmp_path) == result
    calls = []
    monkeypatch.setattr(fm, "_measure", lambda cfg, mt, key, *started: calls.append(mt) or {**result, "seconds": -1.0})
    assert fm.measure_config(cfg, cache_dir=tmp_path, refresh=True)["seconds"] == -1.0
    assert calls == [cfg["model_type"]]
    assert json.loads(path.read_text())["seconds"] == -1.0


# --- dropout ---------------------------------------------------------------------------------------------------------
def test_dropout_masks_count(tmp_path):
    h = GPT2["n_embd"]
    drop = fm.measure_config(GPT2, cache_dir=tmp_path)  # gpt2's default: 0.1 on embeddings, attention, residuals
    still = fm.measure_config({**GPT2, "resid_pdrop": 0, "embd_pdrop": 0, "attn_pdrop": 0}, cache_dir=tmp_path)
    kind = "GPT2Block"
    for key in ("4/sdpa/none", "2/sdpa/none", "4/eager/none", "2/eager/none"):
        (a, c), (a0, c0) = drop["saved"][key][kind], still["saved"][key][kind]
        # Two residual dropouts per block, each a 1-byte mask per element (as CUDA keeps it) whatever the dtype.
        assert a - a0 == 2 * h, key
        # Eager drops the (b, heads, s, s) probabilities out: a 1-byte mask and the dropped-out probabilities
        # (which the matmul with v saves instead of the softmax output, still saved by the softmax). sdpa drops out
        # inside the fused kernel, as on a GPU: no s*s tensor.
        act_bytes = int(key[0])
        assert c - c0 == (GPT2["n_head"] * (1 + act_bytes) if "eager" in key else 0), key
    for key in ("4/sdpa", "2/eager"):
        assert drop["head_saved"][key][0] - still["head_saved"][key][0] == h  # the embedding dropout's mask
    # Fully checkpointed, a block keeps only its input: dropout changes nothing.
    assert drop["saved"]["2/sdpa/full"] == still["saved"]["2/sdpa/full"] == {kind: [2 * h, 0]}


# --- bad input -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        ({"model_type": "llamma", **SMALL}, ["'llamma'", "does not know it", "did you mean"]),
        (
            {"model_type": "llama", **SMALL, "hidden_size": 65},
            ["'llama'", "rejects the config", "validate_architecture': ValueError: "],
        ),
        ({"model_type": "llama", **SMALL, "hidden_act": "no-such-activation"}, ["'llama'", "cannot build"]),
        ({"model_type": "t5"}, ["'t5'", "cannot build a causal LM"]),
        ({"hidden_size": 64}, ["no model_type"]),
    ],
    ids=["unknown-model-type", "rejected-config", "unbuildable", "not-a-causal-lm", "no-model-type"],
)
def test_bad_configs_are_one_line_spec_errors(cfg, words, tmp_path):
    with pytest.raises(SpecError) as e:
        fm.measure_config(cfg, cache_dir=tmp_path)
    message, code = describe(e.value)
    assert code == 2 and "\n" not in message and "Traceback" not in message
    for w in words:
        assert w in message
    assert not list(tmp_path.iterdir())  # nothing cached


def test_a_model_without_decoder_layers_is_a_spec_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()]))
    with pytest.raises(SpecError, match="'toy': cannot find the decoder layers"):
        decoder_layers(model, "toy")


def test_importing_the_module_and_a_cache_hit_do_not_import_torch(llama, tmp_path):
    (tmp_path / f"{llama['config_hash']}.json").write_text(json.dumps(llama))
    code = (
        "import json, sys; from llmctl.measure import fake as fm; "
        f"r = fm.measure_config(json.loads({json.dumps(LLAMA)!r}), cache_dir={str(tmp_path)!r}); "
        "print(r['total_params'], 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert run.stdout.split() == [str(llama["total_params"]), "False", "False"]


def test_a_forward_that_fails_on_fake_tensors_is_one_line(tmp_path, monkeypatch, capfd):
    # A fake kernel that fails (as data-dependent model code does): torch logs the traceback, llmctl says one line.
    monkeypatch.setattr(torch.nn.functional, "silu", lambda x, inplace=False: torch.mm(x, x))
    with pytest.raises(SpecError) as e:
        fm.measure_config(LLAMA, cache_dir=tmp_path)
    message, code = describe(e.value)
    assert code == 2 and "\n" not in message
    assert "'llama': cannot run its forward on fake tensors: RuntimeError" in message
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


# --- the analytical families, measured: the two paths agree -----------------------------------------------------------
from llmctl.families import REGISTRY  # noqa: E402
from llmctl.plan import memory as mem  # noqa: E402
from llmctl.spec import models  # noqa: E402
from tests.family_configs import tiny  # noqa: E402


def long_tiny(model_type: str) -> dict:
    """The registry's tiny config with 512 positions, not 128: measure_config fits through a quarter and half of the
    positions and checks at all of them (llmctl.measure.fake._seq_lens: 128, 256, 512 here, not 32, 64, 128), and the
    check below at s=384 then stays within the positions (GPT-2's are learned: it could not run past them)."""
    return tiny(model_type, **{"n_positions" if model_type == "gpt2" else "max_position_embeddings": 512})


# (family, kernel) pairs not yet within 2% analytically: none (Llama 4 and Phi-3 under sdpa were, until modelled).
ANALYTICAL_GAPS: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def measured_families(tmp_path_factory) -> dict:
    """Every family measured (seconds each, one CPU core each: fake tensors run Python, not kernels), in processes
    of their own on the machine's cores."""
    cache = tmp_path_factory.mktemp("measured")
    measure = partial(fm.measure_config, cache_dir=cache)
    workers = min(len(REGISTRY), os.cpu_count() or 1)
    if workers < 2:
        return {mt: measure(long_tiny(mt)) for mt in REGISTRY}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(REGISTRY, pool.map(measure, [long_tiny(mt) for mt in REGISTRY]), strict=True))


@pytest.mark.parametrize("family", list(REGISTRY))
def test_the_analytical_families_measure_as_they_are_modelled(measured_families, family):
    """Parameters (total and per token, kind by kind) exactly, and every block's saved bytes within 2%, in fp32 and
    bf16, sdpa and eager, with and without full checkpointing, at a shape the fit never saw (b=2, s=384)."""
    m = measured_families[family]
    spec = models.from_hf_config(long_tiny(family), name=family)
    assert m["total_params"] == spec.params
    assert m["embedding_params"] + m["head_params"] == spec.embedding_params + spec.head_params
    kinds = {k["kind"]: k for k in m["layers"]}
    active = m["embedding_params"] + m["head_params"]
    for k in m["layers"]:
        layers = {spec.layers[i] for i in k["indices"]}
        assert {spec.params_of(la) for la in layers} == {k["params"]}, k["kind"]
        assert {spec.active_params_of(la) for la in layers} == {k["active_params"]}, k["kind"]
        active += k["active_params"] * k["count"]
    assert active == spec.active_params_per_token
    b, s = 2, 384
    checked = 0
    for key, per_kind in m["saved"].items():
        ab, attention, ckpt = key.split("/")
        if (family, attention) in ANALYTICAL_GAPS or m["attention_used"][attention] != attention:
            continue
        for kind, (lin, quad) in per_kind.items():
            got = lin * b * s + quad * b * s * s
            for i in kinds[kind]["indices"]:
                want = mem.layer_saved_bytes(spec, b, s, int(ab), attention, ckpt, spec.layers[i])
                assert want == pytest.approx(got, rel=0.02), (key, kind, i, want, got)
                checked += 1
    # Every (dtype, checkpointing) pair of every kernel the model has and we model, at every layer of the tiny model.
    kernels = [a for a in ("sdpa", "eager") if m["attention_used"][a] == a and (family, a) not in ANALYTICAL_GAPS]
    assert checked == 4 * len(kernels) * spec.num_layers
    assert kernels or family in {f for f, _ in ANALYTICAL_GAPS}
