"""The activation model against what PyTorch really saves for backward (saved_tensors_hooks through the saved-bytes
harness, llmctl.measure.saved), on the CPU."""

import pytest

from llmctl.plan import memory as mem
from llmctl.spec import models

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.measure.saved import SavedBytes  # noqa: E402

LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 256,
    "n_head": 8,
    "n_layer": 2,
    "vocab_size": 512,
    "n_positions": 2048,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def saved_bytes(cfg: dict, b: int, s: int, dtype, attention: str, checkpointing: bool) -> int:
    """Bytes of distinct storages saved for backward during one forward (parameters excluded; q/k/v share one input,
    counted once: llmctl.measure.saved)."""
    cfg = dict(cfg)
    mt = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(mt, **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(dtype)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()  # non-reentrant
    ids = torch.randint(0, config.vocab_size, (b, s))
    with SavedBytes(model.parameters()) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    assert loss.requires_grad
    return saved.total()


def predicted_saved(cfg: dict, b: int, s: int, act_bytes: int, attention: str, checkpointing: bool) -> int:
    """The estimator's saved-for-backward bytes: blocks + final norm/head input + the loss's fp32 log-softmax."""
    spec = models.from_hf_config(cfg, name="test")
    if checkpointing:
        blocks = spec.num_layers * act_bytes * b * s * spec.hidden_size
    else:
        blocks = spec.num_layers * mem.layer_activation_bytes(spec, b, s, act_bytes, attention)
    return blocks + mem.head_activation_bytes(spec, b, s, act_bytes) + 4 * b * s * spec.vocab_size


CASES = [
    # (config, b, s, dtype, attention, checkpointing)
    (LLAMA, 2, 128, torch.bfloat16, "sdpa", False),
    (LLAMA, 2, 128, torch.float32, "eager", False),
    (LLAMA, 1, 512, torch.bfloat16, "eager", False),  # long sequence: the s^2 term dominates
    (LLAMA, 2, 128, torch.bfloat16, "sdpa", True),
    (GPT2, 2, 128, torch.bfloat16, "eager", False),
    (GPT2, 2, 128, torch.float32, "sdpa", False),
    (GPT2, 1, 512, torch.float32, "eager", False),
    (GPT2, 4, 64, torch.bfloat16, "sdpa", True),
]


@pytest.mark.parametrize(
    "cfg,b,s,dtype,attention,ckpt",
    CASES,
    ids=[f"{c['model_type']}-b{b}-s{s}-{str(d)[6:]}-{a}{'-ckpt' if k else ''}" for c, b, s, d, a, k in CASES],
)
def test_activation_bytes_match_measurement(cfg, b, s, dtype, attention, ckpt):
    measured = saved_bytes(cfg, b, s, dtype, attention, ckpt)
    act_bytes = 4 if dtype == torch.float32 else 2
    predicted = predicted_saved(cfg, b, s, act_bytes, attention, ckpt)
    # The issue asks for 10%; the tensor-by-tensor model is exact but for a few position-id bytes.
    assert predicted == pytest.approx(measured, rel=0.01), (predicted, measured)
