"""Golden numbers for the memory model, with the hand arithmetic written out."""

import pytest

from llmctl.errors import InputError
from llmctl.plan import memory as mem
from llmctl.spec import models
from llmctl.spec.setup import DEFAULT_CUDA_CONTEXT_BYTES, TrainSetup

N_7B = 6_738_415_616  # Llama-2-7B


def by_name(est):
    return {c.name: c.bytes for c in est.components}


def test_llama2_7b_classic_18_bytes_on_one_gpu():
    spec = models.from_preset("llama-2-7b")
    setup = TrainSetup(precision="bf16-mixed", optimizer="adamw", strategy="no_shard", engine="zero")
    est = mem.estimate(spec, setup)
    # 4 fp32 master + 2 bf16 weights + 4 fp32 grads + 8 Adam (m, v in fp32) = 18 bytes/param
    assert mem.classic_bytes_per_param(spec, setup) == 18
    assert est.model_state_bytes == 18 * N_7B == 121_291_481_088  # 112.96 GiB: never fits one 80 GB GPU


def test_llama2_7b_fsdp2_full_shard_8_gpus():
    spec = models.from_preset("llama-2-7b")
    setup = TrainSetup(
        precision="bf16-mixed",
        strategy="full_shard",
        engine="fsdp2",
        nodes=1,
        gpus_per_node=8,
        micro_batch_size=1,
        seq_len=1024,
        attention="sdpa",
    )
    c = by_name(mem.estimate(spec, setup))
    # FSDP2 keeps fp32 params (4) + fp32 grads (4) + Adam (8) = 16 bytes/param, all sharded 8 ways.
    assert c["parameters (fp32 master, sharded)"] == 4 * N_7B // 8 == 3_369_207_808
    assert c["optimizer states (adamw)"] == 8 * N_7B // 8
    # One layer: q,k,v,o 4*4096^2 + SwiGLU 3*4096*11008 + 2 norms*4096 = 202,383,360 params.
    per_layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert spec.params_per_layer == per_layer == 202_383_360
    # Two layers gathered in bf16 (current + prefetched), minus the local shard already held: 2*P*2*(7/8).
    assert c["unsharded layers (FSDP all-gather)"] == int(2 * per_layer * 2 * 7 / 8) == 708_341_760
    # Activations, b=1 s=1024 h=4096 i=11008 a=32 (bf16, sdpa), per layer:
    sb, h, i = 1024, 4096, 11008
    norms = 2 * (4 * sb * h + 4 * sb + 2 * sb * h)  # fp32 input + rsqrt + bf16 normalised, x2 norms
    attn = 2 * sb * h + 2 * sb * (h + 2 * h) + 2 * sb * h  # qkv input, q k v, output
    mlp = 2 * sb * h + 4 * 2 * sb * i  # mlp input, gate, up, silu(gate), product
    lse = 4 * 32 * sb
    assert norms + attn + mlp + lse == 190_980_096
    rotary = 2 * 1024 * 128 * 2  # cos and sin, 1 x s x head_dim bf16, shared by all layers
    assert c["activations (saved for backward)"] == 32 * 190_980_096 + rotary == 6_111_887_360
    # Logits held in bf16 + fp32 log-softmax: (2 + 4) * b*s*V
    # The loss keeps its fp32 log-softmax (4*b*s*V) into backward; the bf16 logits and their fp32 upcast (2 + 4) live
    # only in forward; backward adds the two fp32 gradients (8*b*s*V).
    assert c["loss log-softmax (fp32, b*s*V)"] == 4 * 1024 * 32000
    assert c["logits (b*s*V, until the loss)"] == 6 * 1024 * 32000
    assert c["loss backward buffers"] == 8 * 1024 * 32000


def test_gpt2_fp32_eager_single_gpu():
    spec = models.from_preset("gpt2")
    setup = TrainSetup(precision="fp32", strategy="no_shard", micro_batch_size=4, seq_len=1024, attention="eager")
    est = mem.estimate(spec, setup)
    c = by_name(est)
    assert est.model_state_bytes == 16 * 124_439_808 == 1_991_036_928  # 4 params + 4 grads + 8 Adam
    sb, h, i, a = 4 * 1024, 768, 3072, 12
    norms = 2 * (4 * sb * h + 2 * 4 * sb)  # LayerNorm input + mean + rstd, x2
    attn = 4 * sb * h * 6  # c_attn input, q|k|v (3), output, c_fc input
    mlp = 5 * 4 * sb * i  # gelu_new keeps 4 tensors + c_proj input
    scores = 4 * 4 * a * 1024 * 1024  # fp32 softmax b*a*s^2
    assert norms + attn + mlp + scores == 553_713_664
    # GPT-2's default dropout (0.1): on the attention probabilities a bool mask (CUDA) and the dropped fp32 copy the
    # AV matmul keeps; on the two residual branches a bool mask each.
    dropout = 4 * a * 1024 * 1024 * (1 + 4) + 2 * sb * h
    mask = 4 * 1024 * 1024 * 4  # eager's causal mask, b x 1 x s x s fp32, kept once for all blocks
    assert c["activations (saved for backward)"] == 12 * (553_713_664 + dropout) + mask
    assert est.peak_phase == "loss_backward"  # the loss buffers of b*s*V, before any layer's backward
    # No sharding: no FSDP transient lines.
    assert "unsharded layers (FSDP all-gather)" not in c


def test_checkpointing_keeps_block_inputs_plus_one_recomputed_block():
    spec = models.from_preset("llama-2-7b")
    base = TrainSetup(gpus_per_node=8, seq_len=4096, micro_batch_size=2)
    full = TrainSetup(gpus_per_node=8, seq_len=4096, micro_batch_size=2, checkpointing="full")
    c0, c1 = by_name(mem.estimate(spec, base)), by_name(mem.estimate(spec, full))
    rotary = 2 * 4096 * 128 * 2  # cos and sin, shared by all layers
    assert c1["activations (block inputs, checkpointed)"] == 32 * 2 * (2 * 4096 * 4096) + rotary  # L * bf16 * b*s*h
    assert c1["recomputed block (backward)"] == (c0["activations (saved for backward)"] - rotary) // 32


def test_peak_is_largest_phase_not_sum():
    spec = models.from_preset("llama-2-7b")
    # foreach AdamW: its step temporaries live only in the optimizer phase, activations only before it.
    est = mem.estimate(spec, TrainSetup(gpus_per_node=8, seq_len=2048, fused_optimizer=False))
    assert est.peak_allocated_bytes == max(est.phase_bytes.values())
    assert est.peak_allocated_bytes < sum(c.bytes for c in est.components)
    assert est.device_bytes == est.peak_allocated_bytes + est.headroom_bytes + DEFAULT_CUDA_CONTEXT_BYTES
    assert est.headroom_bytes == int(est.peak_allocated_bytes * 0.1)  # the default allocator headroom: 10% of peak


@pytest.mark.parametrize("opt,bpp", [("adamw", 8), ("lion", 4), ("sgd", 4), ("adamw-8bit", 2 + 8 / 256)])
def test_optimizer_state_bytes(opt, bpp):
    spec = models.from_preset("gpt2")
    assert mem.optimizer_bytes_per_param(spec, opt, 4) == pytest.approx(bpp)


def test_adafactor_is_factored():
    spec = models.from_preset("gpt2")
    # GPT-2's c_fc (768 x 3072) needs 768 + 3072 floats instead of 768*3072: far below 1 byte/param overall.
    assert 0 < mem.optimizer_bytes_per_param(spec, "adafactor", 4) < 0.2


def test_inference_is_weights_only():
    spec = models.from_preset("llama-2-7b")
    est = mem.estimate(spec, TrainSetup(optimizer="none", strategy="no_shard"))
    assert est.model_state_bytes == 2 * N_7B
    assert list(est.phase_bytes) == ["forward"]


def test_tp_pp_divide_states():
    spec = models.from_preset("llama-2-70b")
    one = mem.estimate(spec, TrainSetup(strategy="no_shard", engine="zero", gpus_per_node=8))
    tp8 = mem.estimate(spec, TrainSetup(strategy="no_shard", engine="zero", gpus_per_node=8, tp=8))
    assert tp8.model_state_bytes == pytest.approx(one.model_state_bytes / 8, rel=0.001)  # norms replicated
    pp4 = mem.pipeline_rank_estimates(
        spec, TrainSetup(strategy="no_shard", engine="zero", gpus_per_node=8, tp=2, pp=4, grad_accum_steps=4)
    )
    # torchtitan's split: 80 blocks + embedding + head = 82 "layers" over 4 stages, 21, 21, 20, 20: embedding + 20
    # blocks, 21 blocks, 20 blocks, 19 blocks + norm + head. The most states are the second stage's 21 blocks, / tp 2.
    expected = 21 * spec.params_per_layer / 2
    assert max(e.model_state_bytes for e in pp4) == pytest.approx(18 * expected, rel=0.001)


def test_max_micro_batch_and_min_gpus():
    spec = models.from_preset("llama-2-7b")
    gpu = 80 * 1024**3
    setup = TrainSetup(gpus_per_node=8, seq_len=1024)
    b = mem.max_micro_batch(spec, setup, gpu)
    assert b >= 1
    assert mem.fits(mem.estimate(spec, TrainSetup(gpus_per_node=8, seq_len=1024, micro_batch_size=b)), gpu)
    assert not mem.fits(mem.estimate(spec, TrainSetup(gpus_per_node=8, seq_len=1024, micro_batch_size=b + 1)), gpu)
    m = mem.min_gpus(spec, setup, gpu, "full_shard")
    assert m.gpus == 2 and m.nodes == 1
    assert mem.min_gpus(spec, setup, gpu, "no_shard").gpus is None  # 18+ bytes/param replicated > 80 GB
    # 405B: without checkpointing its activations alone (126 layers) exceed 80 GB at any GPU count.
    assert mem.min_gpus(models.from_preset("llama-3.1-405b"), setup, gpu, "full_shard").gpus is None
    ckpt = TrainSetup(gpus_per_node=8, seq_len=1024, checkpointing="full")
    big = mem.min_gpus(models.from_preset("llama-3.1-405b"), ckpt, gpu, "full_shard")
    assert big.nodes is not None and big.nodes > 1 and big.gpus == 8 * big.nodes


@pytest.mark.parametrize(
    "kw",
    [
        dict(micro_batch_size=0),
        dict(seq_len=-1),
        dict(gpus_per_node=3, tp=2),
        dict(strategy="hybrid_shard"),
        dict(strategy="zero1"),
        dict(precision="fp4"),  # fp8 is an alias of fp8-tensorwise now
        dict(attention="flash", precision="fp32"),
    ],
)
def test_bad_setups_rejected(kw):
    with pytest.raises(InputError):
        TrainSetup(**kw)
