"""LoRA's memory against what autograd really saves, and the ledger's adapter lines (issue 29).

The activations: a family's tiny config built by transformers on the CPU, peft's `inject_adapter_in_model` on it (the
engine's way), the base frozen, one forward under the saved-bytes harness (llmctl.measure.saved), each decoder block's
saved storages against llmctl.plan.memory.adapters' model (full training's block plus the adapters' terms): dropout 0
and > 0, checkpointing none and full, Llama, Qwen3 (q/k norms, tied embeddings) and GPT-2 (Conv1D, LayerNorm).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.plan import memory as mem
from llmctl.plan.memory import adapters as lora
from llmctl.spec import models
from llmctl.spec.finetune import Finetune, targets_for
from llmctl.spec.setup import TrainSetup
from tests.family_configs import tiny

B, S, RANK = 2, 64, 8


def _spec(family: str) -> tuple[dict, models.ModelSpec]:
    cfg = tiny(family)
    if family == "gpt2":  # GPT-2's own dropout would add masks of its own (tests/plan/test_families_measured.py)
        cfg.update(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return cfg, models.from_hf_config(cfg, name=family)


def measure(family: str, dtype_name: str, dropout: float, checkpointing: bool) -> dict:
    """Bytes each decoder block (and "outside") saves in one forward with LoRA adapters on a frozen base."""
    torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
    transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")
    peft = pytest.importorskip("peft", reason="needs peft (pip install 'llmctl[lora]')")
    from llmctl.measure.saved import saved_per_block

    cfg, spec = _spec(family)
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    attention = "eager" if family == "gpt2" else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    targets = targets_for(spec, Finetune("lora", RANK))
    lora_config = peft.LoraConfig(
        r=RANK, lora_alpha=2 * RANK, lora_dropout=dropout, target_modules=list(targets), fan_in_fan_out=spec.is_gpt2
    )
    model = peft.inject_adapter_in_model(lora_config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    model = model.to(getattr(torch, dtype_name)).train()
    return saved_per_block(model, B, S, config.vocab_size, checkpointing)


CASES = [
    (f, d, p, c)
    for f in ("llama", "qwen3", "gpt2")
    for d in ("float32", "bfloat16")
    for p in (0.0, 0.1)
    for c in (False, True)
]


@pytest.mark.parametrize(
    "family,dtype,dropout,ckpt", CASES, ids=[f"{f}-{d}-p{p}-{'full' if c else 'none'}" for f, d, p, c in CASES]
)
def test_lora_block_activations_match_autograd(family, dtype, dropout, ckpt):
    _, spec = _spec(family)
    ft = Finetune("lora", RANK, dropout=dropout)
    ab = 4 if dtype == "float32" else 2
    attention = "eager" if family == "gpt2" else "sdpa"
    got = measure(family, dtype, dropout, ckpt)
    # The rotary tables are first saved in the first block; eager's causal mask outside the blocks.
    shared = mem.shared_activation_bytes(spec, B, S, ab, "sdpa" if attention == "sdpa" else "flash")
    for i, layer in enumerate(spec.layers):
        if ckpt:
            if i == 0:
                continue  # the first block's checkpoint input: as in full training (test_families_measured)
            predicted = mem.layer_saved_bytes(spec, B, S, ab, attention, "full", layer)
            assert got[i] == predicted, (i, got[i], predicted)
            continue
        # CPU dropout keeps its mask in the input's dtype (CUDA: bool, the estimator's default).
        predicted = mem.layer_activation_bytes(spec, B, S, ab, attention, layer, mask_bytes=ab)
        predicted += lora.adapter_layer_delta(spec, layer, B, S, ab, attention, ft, mask_bytes=ab)
        if i == 0:
            predicted += lora.first_block_delta(spec, B, S, ab, ft, mask_bytes=ab) + shared
        assert got[i] == pytest.approx(predicted, rel=0.005), (i, got[i], predicted)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_estimate_total_matches_autograd(family, dropout):
    """The estimate's saved bytes (the activations line, the final norm + LM-head input line and the loss's fp32
    log-softmax) against everything autograd saves in one fp32 forward, blocks and outside: GPT-2's position ids
    (8*s bytes, wpe's backward would read them) and one fp32 scalar of the loss are the only bytes not modelled."""
    _, spec = _spec(family)
    attention = "eager" if family == "gpt2" else "sdpa"
    ft = Finetune("lora", RANK, dropout=dropout)
    setup = TrainSetup(precision="fp32", finetune=ft, micro_batch_size=B, seq_len=S, attention=attention)
    est = mem.estimate(spec, setup)
    kept = ("activations", "final norm", "loss log-softmax")
    predicted = sum(c.bytes for c in est.components if c.name.startswith(kept))
    # The CPU's dropout keeps its mask in the input's dtype, the estimate CUDA's bool mask.
    masks = sum(S * B * i * 3 for la in spec.layers for _, i, _ in lora.layer_adapters(spec, la, ft)) if dropout else 0
    masks += lora.first_block_delta(spec, B, S, 4, ft, mask_bytes=4) - lora.first_block_delta(spec, B, S, 4, ft, 1)
    if family == "gpt2":
        # full training's model counts eager's materialised causal mask (b*s^2), which GPT-2's blocks do not save
        # (tests/plan/test_families_measured.py leaves it out too): not an adapter's term
        masks -= mem.shared_activation_bytes(spec, B, S, 4, "eager")
    got = sum(measure(family, "float32", dropout, False).values())
    assert predicted + masks == pytest.approx(got, abs=(8 * S if family == "gpt2" else 0) + 4), (predicted + masks, got)


# --- the ledger: exact numbers ------------------------------------------------------------------------------------
LLAMA_8B_ADAPTERS = 41_943_040
"""peft's trainable parameters for Llama-3.1-8B, r16 on q/k/v/o/gate/up/down (print_trainable_parameters)."""


def _llama_8b() -> models.ModelSpec:
    return models.resolve_model("llama-3.1-8b", None)


def test_llama_8b_lora_ledger_on_one_gpu():
    spec = _llama_8b()
    est = mem.estimate(spec, TrainSetup(finetune=Finetune("lora", 16), gpus_per_node=1))
    by_name = {c.name: c.bytes for c in est.components}
    assert by_name["frozen base (bf16, sharded)"] == 2 * spec.params
    assert by_name["LoRA adapters (fp32, r16, sharded)"] == 4 * LLAMA_8B_ADAPTERS
    # a mutant that keeps gradients for the frozen base would put 4 x 8.03B here
    assert by_name["gradients (fp32, adapters only)"] == 4 * LLAMA_8B_ADAPTERS
    assert by_name["optimizer states (adamw, adapters only)"] == 8 * LLAMA_8B_ADAPTERS
    states = sum(c.bytes for c in est.components if c.bytes_per_param is not None)
    assert states == 2 * spec.params + 16 * LLAMA_8B_ADAPTERS
    # the ledger reads per model parameter: 2 + 16 x 41.9M / 8.03B
    assert mem.classic_bytes_per_param(spec, est.setup) == pytest.approx(2 + 16 * LLAMA_8B_ADAPTERS / spec.params)


def test_adapter_states_shard_over_fsdp():
    spec = _llama_8b()
    est = mem.estimate(spec, TrainSetup(finetune=Finetune("lora", 16), gpus_per_node=8))
    by_name = {c.name: c.bytes for c in est.components}
    assert by_name["optimizer states (adamw, adapters only)"] == 8 * LLAMA_8B_ADAPTERS // 8
    assert by_name["frozen base (bf16, sharded)"] == -(-2 * spec.params // 8)
    # the reduce-scatter's buffer: one layer's adapter gradients (bf16 + fp32 upcast), not the layer's weights
    layer_adapters = LLAMA_8B_ADAPTERS // spec.num_layers
    assert by_name["unsharded layer gradients (reduce-scatter)"] == 6 * layer_adapters


def test_qlora_base_is_nf4_in_the_blocks():
    spec = _llama_8b()
    est = mem.estimate(spec, TrainSetup(finetune=Finetune("qlora", 16), gpus_per_node=1))
    base = next(c.bytes for c in est.components if c.name.startswith("frozen base"))
    q = lora.quantized_params(spec)
    # every block's linear (the norms are 2 x 4096 per block): the embeddings and the LM head stay bf16
    assert q == spec.num_layers * (spec.params_per_layer - 2 * spec.hidden_size)
    # torchao's NF4 (the engine's): 4-bit codes, an int8 absmax per 64, a bf16 scale per 256 absmaxes, and per
    # tensor and shard the absmaxes' mean and the 16 levels in bf16 (7 linears x 32 layers, one GPU)
    assert base == pytest.approx(q * (0.5 + 1 / 64 + 2 / 16384) + 224 * 34 + 2 * (spec.params - q), abs=1)
    dequant = next(c for c in est.components if c.name.startswith("QLoRA"))
    assert dequant.bytes == 2 * 4096 * 14336  # the largest linear (gate, up, down) in bf16


def test_dropout_copies_and_lora_a_outputs_are_counted():
    """A mutant that forgets the dropped copy (or lora_A's output) misses these bytes per block."""
    spec = _llama_8b()
    b, s = 1, 4096
    layer = spec.layers[0]
    none = lora.adapter_layer_delta(spec, layer, b, s, 2, "sdpa", Finetune("lora", 16))
    drop = lora.adapter_layer_delta(spec, layer, b, s, 2, "sdpa", Finetune("lora", 16, dropout=0.05))
    ins = sum(i for _, i, _ in lora.layer_adapters(spec, layer, Finetune("lora", 16)))
    h, i = spec.hidden_size, layer.mlp.intermediate_size
    # dropout: each adapter's dropped copy (bf16) and bool mask; the shared inputs no longer kept (qkv, gate/up, down)
    assert drop - none == b * s * ins * (2 + 1) - 2 * b * s * (h + h + i)
    # lora_A's outputs: 7 adapters x b*s*r in bf16, less the two norms' outputs the frozen weights do not keep
    assert none == 7 * 2 * b * s * 16 - 2 * 2 * b * s * h


def test_lora_fits_where_full_does_not():
    spec = _llama_8b()
    full = mem.estimate(spec, TrainSetup(gpus_per_node=1))
    adapters = mem.estimate(spec, TrainSetup(finetune=Finetune("lora"), gpus_per_node=1))
    qlora = mem.estimate(spec, TrainSetup(finetune=Finetune("qlora"), gpus_per_node=1))
    assert qlora.device_bytes < adapters.device_bytes < 80 * 2**30 < full.device_bytes


# --- invariants (hypothesis) ----------------------------------------------------------------------------------------
SPECS = [models.from_preset(n) for n in ("gpt2", "llama-3.1-8b", "mixtral-8x7b", "qwen2.5-7b")]
lora_setups = st.builds(
    TrainSetup,
    precision=st.sampled_from(["bf16-mixed", "bf16", "fp16-mixed"]),
    optimizer=st.sampled_from(["adamw", "adamw-8bit", "lion", "adafactor"]),
    micro_batch_size=st.integers(1, 8),
    seq_len=st.sampled_from([128, 1024, 4096]),
    checkpointing=st.sampled_from(["none", "selective", "full"]),
    attention=st.sampled_from(["eager", "sdpa"]),
    gpus_per_node=st.sampled_from([2, 4, 8]),
    finetune=st.builds(
        Finetune,
        method=st.sampled_from(["lora", "qlora"]),
        rank=st.sampled_from([1, 8, 64, 256]),
        dropout=st.sampled_from([0.0, 0.1]),
    ),
)


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(SPECS), setup=lora_setups)
def test_adapters_never_need_more_than_full_training_nor_grow_with_shards(spec, setup):
    est = mem.estimate(spec, setup)
    assert all(c.bytes >= 0 for c in est.components)
    assert est.model_state_bytes < mem.estimate(spec, replace(setup, finetune=Finetune())).model_state_bytes
    bigger = mem.estimate(spec, replace(setup, nodes=2))
    assert bigger.peak_allocated_bytes <= est.peak_allocated_bytes
    if setup.finetune.method == "qlora":
        lora_est = mem.estimate(spec, replace(setup, finetune=replace(setup.finetune, method="lora")))
        assert est.model_state_bytes < lora_est.model_state_bytes
