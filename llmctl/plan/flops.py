"""FLOPs per token and the throughput metrics built on them (torch-free). Shared by the planner and the engine.

Conventions (stated once, used everywhere):
- Model FLOPs per token = 6 * N_matmul + 12 * L * (a * d) * s  (PaLM, Chowdhery et al. 2022, appendix B:
  6N for the forward+backward matmuls, 12*L*H*Q*T for the attention scores and values). N_matmul counts every
  weight that takes part in a matmul: all parameters but the input embedding lookup (the LM head counts; a
  tied embedding is the LM head and counts once). MoE counts only the routed experts.
- Hardware FLOPs add the recomputation (recompute_flops_per_token), derived from what each checkpointing mode
  (llmctl.spec.checkpointing) re-runs: full re-runs every block's forward (its matmuls and the attention scores:
  about 8N instead of 6N, Narayanan et al. 2021 eq. 3, but not the LM head, which no mode checkpoints); partial:K the
  forward of L // K blocks; selective only the matmuls whose outputs it does not keep (every other one, and the
  attention scores when the attention is not a fused kernel whose output is kept); the chunked loss re-runs the LM
  head's forward matmul.
- MFU = model FLOPs per second per device / device peak (PaLM's definition: recompute does not count).
"""

from __future__ import annotations

from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.models import ModelSpec


def matmul_params(spec: ModelSpec) -> int:
    """Parameters that take part in matmuls for one token (see module docstring)."""
    n = spec.active_params_per_token - spec.embedding_params
    if spec.tie_embeddings:
        n += spec.vocab_size * spec.hidden_size  # the tied matrix is used as the LM head
    return n


def attention_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    """12 * L * (heads * head_dim) * s: QK^T and AV, forward (2 matmuls x 2 FLOPs) + backward (x2)."""
    return 12 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    return 6 * matmul_params(spec) + attention_flops_per_token(spec, seq_len)


def layer_matmuls(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, input features, output features) of the matmuls one token goes through in one block, in the order the
    block runs them (Hugging Face's LlamaDecoderLayer / MixtralSparseMoeBlock / GPT2Block). An MoE token runs the
    router, then for each of its k experts gate_up and down (MixtralExperts.forward loops over the experts)."""
    h, a, kv, d, i = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    if spec.is_gpt2:
        return [("c_attn", h, 3 * h), ("attn.c_proj", h, h), ("c_fc", h, i), ("mlp.c_proj", i, h)]
    out = [("q_proj", h, a * d), ("k_proj", h, kv * d), ("v_proj", h, kv * d), ("o_proj", a * d, h)]
    if spec.num_experts:
        out.append(("router", h, spec.num_experts))
        for _ in range(spec.experts_per_token):
            out += [("expert gate_up", h, 2 * i), ("expert down", i, h)]
    else:
        out += [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
    return out


def selective_kept(spec: ModelSpec) -> list[bool]:
    """Per layer_matmuls entry: whether selective checkpointing keeps its output (the 1st, 3rd, 5th... matmul: the
    engine's policy, llmctl.engine.parallelize._sac_context_fn)."""
    return [n % 2 == 0 for n in range(len(layer_matmuls(spec)))]


def recompute_flops_per_token(
    spec: ModelSpec, seq_len: int, checkpointing: str = "none", attention: str = "sdpa", loss_chunked: bool = False
) -> int:
    """FLOPs re-run in backward per token (see the module docstring)."""
    attn_fwd = attention_flops_per_token(spec, seq_len) // 3  # QK^T and AV forward: 4 * L * a * d * s
    layer_fwd = 2 * sum(i * o for _, i, o in layer_matmuls(spec))
    extra = 2 * spec.vocab_size * spec.hidden_size if loss_chunked else 0
    if checkpointing == "none":
        return extra
    if checkpointing == "selective":
        again = sum(2 * i * o for (_, i, o), kept in zip(layer_matmuls(spec), selective_kept(spec)) if not kept)
        # A fused kernel's output (SDPA, flash) is kept; eager attention's matmuls are recomputed.
        scores = attn_fwd if attention == "eager" else 0
        return spec.num_layers * again + scores + extra
    n = len(ckpt_modes.whole_layers(checkpointing, spec.num_layers))
    return n * layer_fwd + attn_fwd * n // max(1, spec.num_layers) + extra


def hardware_flops_per_token(
    spec: ModelSpec, seq_len: int, checkpointing: str = "none", attention: str = "sdpa", loss_chunked: bool = False
) -> int:
    """FLOPs the device really executes: the model's FLOPs plus what checkpointing and the chunked loss re-run."""
    return model_flops_per_token(spec, seq_len) + recompute_flops_per_token(
        spec, seq_len, checkpointing, attention, loss_chunked
    )


def tflops_per_device(flops_per_token: float, tokens_per_s_per_device: float) -> float:
    return flops_per_token * tokens_per_s_per_device / 1e12


def mfu(spec: ModelSpec, seq_len: int, tokens_per_s_per_device: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in [0, 1]."""
    if peak_tflops <= 0:
        return 0.0
    return tflops_per_device(model_flops_per_token(spec, seq_len), tokens_per_s_per_device) / peak_tflops
