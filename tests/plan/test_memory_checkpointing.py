"""Each checkpointing mode's saved-for-backward bytes, and the chunked loss's buffers, against what PyTorch holds.

Measured with llmctl.measure.memtrack (live tensor storages under a TorchDispatchMode, so selective checkpointing's
cache, which saved_tensors_hooks never sees, is counted), on models wrapped by the engine's own
apply_activation_checkpointing and install_loss_forward: the estimator is checked against the code that runs.
"""

from __future__ import annotations

import pytest

from llmctl.plan import memory as mem
from llmctl.spec import models
from llmctl.spec.setup import TrainSetup

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install 'llmctl[train]')")

from llmctl.engine.loss import install_loss_forward, whole_loss  # noqa: E402
from llmctl.engine.parallelize import apply_activation_checkpointing  # noqa: E402
from llmctl.measure.memtrack import measure_step  # noqa: E402
from tests.plan.test_memory_measured import GPT2, LLAMA  # noqa: E402

LLAMA4 = {**LLAMA, "num_hidden_layers": 4, "hidden_size": 128, "intermediate_size": 352, "num_attention_heads": 4}
# A large vocabulary next to a small model: the loss dominates, as with Llama 3 / Qwen / Gemma.
BIG_VOCAB = {**LLAMA, "vocab_size": 16384, "hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4}


def build(cfg: dict, dtype, attention: str):
    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(dtype)
    model.train()
    return model


def measure(cfg: dict, b: int, s: int, dtype, attention: str, mode: str, chunk: int = 0):
    model = build(cfg, dtype, attention)
    apply_activation_checkpointing(model, mode)
    vocab = cfg["vocab_size"]
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))
    if chunk:
        install_loss_forward(model, "chunked", vocab, chunk)
        return measure_step(model, lambda: model(input_ids=ids, labels=ids), ids)
    return measure_step(model, lambda: whole_loss(model, ids, ids, vocab), ids)


def predicted_saved(cfg: dict, b: int, s: int, ab: int, attention: str, mode: str, chunked: bool = False) -> int:
    """Blocks in the mode + what all blocks share + final norm/head input + (whole loss) the fp32 log-softmax."""
    spec = models.from_hf_config(cfg, name="test")
    blocks = mem.stage_activation_bytes(spec, spec.num_layers, b, s, ab, attention, mode)
    shared = mem.shared_activation_bytes(spec, b, s, ab, attention)
    loss = 0 if chunked else 4 * b * s * spec.vocab_size
    return blocks + shared + mem.head_activation_bytes(spec, b, s, ab) + loss


SHAPES = [
    # (config, b, s, dtype, attention)
    (LLAMA, 2, 128, torch.float32, "sdpa"),
    (LLAMA, 2, 128, torch.bfloat16, "eager"),
    (LLAMA, 1, 512, torch.bfloat16, "sdpa"),
    (LLAMA4, 1, 256, torch.float32, "eager"),
    (GPT2, 2, 128, torch.bfloat16, "sdpa"),
    (GPT2, 2, 128, torch.float32, "eager"),
    (GPT2, 1, 256, torch.bfloat16, "eager"),
]
MODES = ["none", "selective", "partial:2", "full"]
CASES = [(*shape, mode) for shape in SHAPES for mode in MODES] + [(LLAMA4, 2, 64, torch.bfloat16, "sdpa", "partial:3")]


@pytest.mark.parametrize(
    "cfg,b,s,dtype,attention,mode",
    CASES,
    ids=[
        f"{c['model_type']}{c.get('num_hidden_layers', '')}-b{b}-s{s}-{str(d)[6:]}-{a}-{m}"
        for c, b, s, d, a, m in CASES
    ],
)
def test_saved_bytes_per_mode_match_measurement(cfg, b, s, dtype, attention, mode) -> None:
    measured = measure(cfg, b, s, dtype, attention, mode).saved_bytes
    ab = 4 if dtype == torch.float32 else 2
    predicted = predicted_saved(cfg, b, s, ab, attention, mode)
    # The issue asks for 3%. Selective, partial and full agree to the position ids (under 0.3% here); eager
    # attention without checkpointing is predicted b*s^2 bytes per layer above what it keeps (1.2% at s=256).
    assert predicted == pytest.approx(measured, rel=0.03), (predicted, measured)


def test_selective_keeps_less_than_none_and_more_than_full() -> None:
    spec = models.from_hf_config(LLAMA, name="t")
    b, s = 1, 4096
    for ab, attn in ((2, "flash"), (2, "sdpa"), (4, "eager")):
        none, sel, full = (mem.layer_saved_bytes(spec, b, s, ab, attn, m) for m in ("none", "selective", "full"))
        assert full < sel < none / 2
        part = mem.stage_activation_bytes(spec, 4, b, s, ab, attn, "partial:2")
        assert part == 2 * none + 2 * full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_loss_drops_the_logits_and_bounds_backward_by_the_chunk(dtype) -> None:
    """Whole: the fp32 log-softmax (4*b*s*V) is held, and backward adds its gradient and the logits' (8*b*s*V).
    Chunked: nothing of the loss is held; backward holds one chunk's pair (8*c*V) plus that chunk's LM-head gradient
    and the accumulated one (V*h each, compute dtype)."""
    b, s, chunk = 2, 128, 64  # chunk < h / 2: the LM head's backward is the chunk's peak (8cV + V*h)
    ab = 4 if dtype == torch.float32 else 2
    spec = models.from_hf_config(BIG_VOCAB, name="t")
    V, h = spec.vocab_size, spec.hidden_size
    whole = measure(BIG_VOCAB, b, s, dtype, "sdpa", "none")
    chunked = measure(BIG_VOCAB, b, s, dtype, "sdpa", "none", chunk)
    assert whole.saved_bytes == pytest.approx(predicted_saved(BIG_VOCAB, b, s, ab, "sdpa", "none"), rel=0.01)
    assert chunked.saved_bytes == pytest.approx(
        predicted_saved(BIG_VOCAB, b, s, ab, "sdpa", "none", chunked=True), rel=0.01
    )
    assert whole.saved_bytes - chunked.saved_bytes == pytest.approx(4 * b * s * V, abs=64)  # the log-softmax
    assert whole.backward_peak_bytes - whole.saved_bytes == pytest.approx(8 * b * s * V, rel=0.03)
    extra = chunked.backward_peak_bytes - chunked.saved_bytes
    accumulated_head_grad = ab * V * h  # the estimator counts it with the gradients
    assert extra == pytest.approx(mem.loss_chunk_backward_bytes(spec, chunk, ab) + accumulated_head_grad, rel=0.03)
    assert chunked.backward_peak_bytes < 0.6 * whole.backward_peak_bytes


def test_estimate_lines_follow_the_chunk() -> None:
    spec = models.from_preset("llama-3.1-8b")
    whole = mem.estimate(spec, TrainSetup(seq_len=8192, checkpointing="selective"))
    chunked = mem.estimate(spec, TrainSetup(seq_len=8192, checkpointing="selective", loss_chunk_tokens=512))
    names = {c.name for c in chunked.components}
    assert "loss log-softmax (fp32, b*s*V)" in {c.name for c in whole.components}
    assert "loss log-softmax (fp32, b*s*V)" not in names and "loss chunk of 512 tokens (backward)" in names
    # 8k tokens x 128k vocabulary: the whole loss holds 4 + 8 bytes per logit at the backward peak
    assert whole.phase_bytes["loss_backward"] - chunked.phase_bytes["loss_backward"] > 10 * 2**30
    # A chunk larger than the micro-batch is the micro-batch
    big = mem.estimate(spec, TrainSetup(seq_len=1024, loss_chunk_tokens=10**6))
    assert "loss chunk of 1024 tokens (forward)" in {c.name for c in big.components}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [128, 256], ids=["c128", "c256"])
def test_a_large_chunk_peaks_in_the_loss_backward(dtype, chunk) -> None:
    """chunk >= h: the peak is the chunk's recomputed log-softmax and its two gradients (3 x 4*c*V), before the LM
    head's backward (benchmarks/checkpointing.py found the 8cV + V*h line short there)."""
    b, s = 2, 256
    ab = 4 if dtype == torch.float32 else 2
    spec = models.from_hf_config(BIG_VOCAB, name="t")
    r = measure(BIG_VOCAB, b, s, dtype, "sdpa", "none", chunk)
    extra = r.backward_peak_bytes - r.saved_bytes - ab * spec.vocab_size * spec.hidden_size  # accumulated head grad
    assert mem.loss_chunk_backward_bytes(spec, chunk, ab) == 12 * chunk * spec.vocab_size
    assert extra == pytest.approx(mem.loss_chunk_backward_bytes(spec, chunk, ab), rel=0.03)


def test_whole_loss_phases_match_the_measured_peaks() -> None:
    """The whole loss: forward peaks with the logits (and their fp32 upcast in bf16) beside what is saved; backward
    with the two fp32 gradients beside the saved log-softmax; the logits are gone by then."""
    spec = models.from_hf_config(BIG_VOCAB, name="t")
    b, s = 2, 128
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        r = measure(BIG_VOCAB, b, s, dtype, "sdpa", "none")
        setup = TrainSetup(precision=precision, micro_batch_size=b, seq_len=s)
        est = {c.name: c.bytes for c in mem.estimate(spec, setup).components}
        assert r.forward_peak_bytes - r.saved_bytes == pytest.approx(est["logits (b*s*V, until the loss)"], rel=0.01)
        assert r.backward_peak_bytes - r.saved_bytes == pytest.approx(est["loss backward buffers"], rel=0.01)
        assert est["loss log-softmax (fp32, b*s*V)"] == 4 * b * s * spec.vocab_size
