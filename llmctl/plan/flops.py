"""FLOPs per token and the throughput metrics built on them (torch-free). Shared by the planner and the engine.

Conventions (stated once, used everywhere):
- Model FLOPs per token = 6 * N_matmul + 12 * L * (a * d) * s  (PaLM, Chowdhery et al. 2022, appendix B:
  6N for the forward+backward matmuls, 12*L*H*Q*T for the attention scores and values). N_matmul counts every
  weight that takes part in a matmul: all parameters but the input embedding lookup (the LM head counts; a
  tied embedding is the LM head and counts once). MoE counts only the routed experts.
- Hardware FLOPs add the recomputation: full activation checkpointing re-runs the forward, so 8N instead of 6N
  (x4/3, Narayanan et al. 2021 eq. 3; the "4 * 2" of docs/sources.md#tune-up-seed).
- MFU = model FLOPs per second per device / device peak (PaLM's definition: recompute does not count).
"""

from __future__ import annotations

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


def hardware_flops_per_token(spec: ModelSpec, seq_len: int, checkpointing: str = "none") -> int:
    """FLOPs the device really executes: full recompute adds one more forward (2N + attention/3)."""
    base = model_flops_per_token(spec, seq_len)
    if checkpointing == "full":
        return base * 4 // 3
    return base


def tflops_per_device(flops_per_token: float, tokens_per_s_per_device: float) -> float:
    return flops_per_token * tokens_per_s_per_device / 1e12


def mfu(spec: ModelSpec, seq_len: int, tokens_per_s_per_device: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation in [0, 1]."""
    if peak_tflops <= 0:
        return 0.0
    return tflops_per_device(model_flops_per_token(spec, seq_len), tokens_per_s_per_device) / peak_tflops
