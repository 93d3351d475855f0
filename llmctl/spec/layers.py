"""One decoder block, described by the parts that decide its parameters, FLOPs and activations (torch-free).

A model is a sequence of blocks (llmctl.spec.models.ModelSpec.layers). Blocks differ inside one model: Gemma and
gpt-oss alternate sliding-window and global attention, Qwen3-MoE and Llama 4 interleave dense and MoE feed-forwards,
DeepSeek-V3's first three blocks are dense. Identical blocks are equal (frozen dataclasses), so per-block results
are computed once per distinct block.

The tensors are listed the way Hugging Face transformers lays the modules out (names follow its modules; shapes are
what it allocates), so that counts equal what transformers instantiates: tests/spec/test_presets.py checks every
preset against a model built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

MAX_LAYERS = 10_000
"""Ten times the deepest published transformer (DeepNet, Wang et al. 2022: 1,000 layers). A model of 10^9 tiny
layers stays under MAX_PARAMS but would take the engine days to build, one module at a time."""

Tensor = tuple[str, tuple[int, ...]]

QK_NORMS = ("none", "head", "proj", "l2")
ACTIVATIONS = ("swiglu", "geglu", "gelu", "swiglu-clamped")


@dataclass(frozen=True)
class Attention:
    """Self-attention of one block: grouped-query (GQA/MQA/MHA) or multi-head latent attention (MLA)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Query/key width per head (MLA: qk_nope_head_dim + qk_rope_head_dim)."""
    v_head_dim: int
    """Value/output width per head (equal to head_dim except in MLA)."""
    qkv_bias: bool = False
    """Biases on q/k/v (Qwen2, gpt-oss, GPT-2, `attention_bias`)."""
    o_bias: bool = False
    """Bias on the output projection (gpt-oss, GPT-2, `attention_bias` in Llama-style modules)."""
    qk_norm: str = "none"
    """head: RMSNorm over each head's head_dim (Qwen3, Gemma 3); proj: RMSNorm over the whole q/k projection
    (OLMo 2); l2: weightless L2 norm (Llama 4's rope layers); none."""
    sinks: bool = False
    """A learned per-head attention-sink logit (gpt-oss)."""
    window: int = 0
    """Keys a query may attend to: a sliding window (Mistral, Gemma, gpt-oss) or Llama 4's attention chunk;
    0 is full causal attention."""
    chunked: bool = False
    """The window is Llama 4's chunked attention (queries see their own chunk), not a sliding window."""
    fused_qkv: bool = False
    """One qkv projection (Phi-3's qkv_proj, GPT-2's c_attn)."""
    softcap: bool = False
    """Attention logits soft-capped, cap * tanh(scores / cap) (Gemma 2's attn_logit_softcapping; eager only)."""
    q_lora_rank: int = 0
    """MLA: rank of the query down-projection (0: a direct q_proj, as DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 0
    """MLA when > 0: rank of the compressed key/value latent (DeepSeek-V2/V3, Kimi K2)."""
    rope_dim: int = 0
    """MLA: qk_rope_head_dim, the rotary part of each query/key head; the key's rotary part is shared by heads."""

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def tensors(self, h: int) -> list[Tensor]:
        a, kv, d, dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        if self.mla:
            # DeepseekV3Attention: q_a -> RMSNorm -> q_b (or q_proj); kv_a_proj_with_mqa gives the latent and the
            # shared rotary key; kv_b expands the latent to per-head nope keys and values.
            b = self.qkv_bias
            t: list[Tensor] = []
            if self.q_lora_rank:
                r = self.q_lora_rank
                t += [("q_a_proj.weight", (r, h)), ("q_a_layernorm.weight", (r,)), ("q_b_proj.weight", (a * d, r))]
                t += [("q_a_proj.bias", (r,))] if b else []
            else:
                t += [("q_proj.weight", (a * d, h))]
            c = self.kv_lora_rank
            t += [
                ("kv_a_proj_with_mqa.weight", (c + self.rope_dim, h)),
                ("kv_a_layernorm.weight", (c,)),
                ("kv_b_proj.weight", (a * (d - self.rope_dim + dv), c)),
                ("o_proj.weight", (h, a * dv)),
            ]
            t += [("kv_a_proj_with_mqa.bias", (c + self.rope_dim,))] if b else []
            t += [("o_proj.bias", (h,))] if self.o_bias else []
            return t
        q, k, v = a * d, kv * d, kv * dv
        if self.fused_qkv:
            t = [("qkv_proj.weight", (q + k + v, h))]
            t += [("qkv_proj.bias", (q + k + v,))] if self.qkv_bias else []
        else:
            t = [("q_proj.weight", (q, h)), ("k_proj.weight", (k, h)), ("v_proj.weight", (v, h))]
            t += [("q_proj.bias", (q,)), ("k_proj.bias", (k,)), ("v_proj.bias", (v,))] if self.qkv_bias else []
        t += [("o_proj.weight", (h, a * dv))]
        t += [("o_proj.bias", (h,))] if self.o_bias else []
        if self.qk_norm == "head":
            t += [("q_norm.weight", (d,)), ("k_norm.weight", (d,))]
        elif self.qk_norm == "proj":
            t += [("q_norm.weight", (q,)), ("k_norm.weight", (k,))]
        if self.sinks:
            t += [("sinks", (a,))]
        return t

    def matmuls(self, h: int) -> list[tuple[str, int, int]]:
        """(name, in features, out features) of the projections one token runs, in forward order."""
        a, kv, d, dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        if self.mla:
            c, r = self.kv_lora_rank, self.q_lora_rank
            q = [("q_a_proj", h, r), ("q_b_proj", r, a * d)] if r else [("q_proj", h, a * d)]
            kv_ = [("kv_a_proj", h, c + self.rope_dim), ("kv_b_proj", c, a * (d - self.rope_dim + dv))]
            return q + kv_ + [("o_proj", a * dv, h)]
        if self.fused_qkv:
            return [("qkv_proj", h, a * d + 2 * kv * d), ("o_proj", a * dv, h)]
        return [("q_proj", h, a * d), ("k_proj", h, kv * d), ("v_proj", h, kv * dv), ("o_proj", a * dv, h)]

    def span(self, seq_len: int) -> float:
        """Keys per query in the PaLM FLOP convention (which counts all s keys for causal attention, twice the
        average a causal query attends to): s for full attention. A sliding window w attends on average
        w - w^2/(2s) keys (ramp-up over the first w positions), so twice that, 2w - w^2/s, which equals s at w = s.
        A chunk c (Llama 4) attends on average about c/2 keys: c in the same convention."""
        s, w = seq_len, self.window
        if not w or w >= s:
            return s
        return w if self.chunked else 2 * w - w * w / s


@dataclass(frozen=True)
class Mlp:
    """The feed-forward of one block: dense, or a mixture of experts with optional shared experts."""

    act: str
    """swiglu (silu(gate) * up), geglu (gelu(gate) * up: Gemma), gelu (fc -> gelu -> proj: GPT-2), swiglu-clamped
    (gpt-oss: clamped gate * sigmoid(1.702 gate) * (up + 1))."""
    intermediate_size: int
    """Dense width, or one routed expert's width."""
    bias: bool = False
    fused_gate_up: bool = False
    """One gate_up projection (Phi-3)."""
    num_experts: int = 0
    experts_per_token: int = 0
    shared_size: int = 0
    """Width of the always-on shared expert(s) (DeepSeek: n_shared_experts x moe_intermediate_size; Llama 4)."""
    router_bias: bool = False
    expert_bias: bool = False
    """Biases on the experts' projections (gpt-oss)."""
    names: tuple[str, str, str] = ("gate", "experts", "shared_experts")
    """Module names of the router, the experts and the shared expert (Llama 4: router, experts, shared_expert)."""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def _dense(self, prefix: str, h: int, i: int, bias: bool) -> list[Tensor]:
        if self.act == "gelu":
            return [(f"{prefix}c_fc.weight", (h, i)), (f"{prefix}c_proj.weight", (i, h))] + (
                [(f"{prefix}c_fc.bias", (i,)), (f"{prefix}c_proj.bias", (h,))] if bias else []
            )
        if self.fused_gate_up:
            t = [(f"{prefix}gate_up_proj.weight", (2 * i, h)), (f"{prefix}down_proj.weight", (h, i))]
            return t + ([(f"{prefix}gate_up_proj.bias", (2 * i,)), (f"{prefix}down_proj.bias", (h,))] if bias else [])
        t = [(f"{prefix}{n}_proj.weight", s) for n, s in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))]
        return t + (
            [(f"{prefix}{n}_proj.bias", (o,)) for n, o in (("gate", i), ("up", i), ("down", h))] if bias else []
        )

    def tensors(self, h: int) -> list[Tensor]:
        i = self.intermediate_size
        if not self.moe:
            return self._dense("", h, i, self.bias)
        e = self.num_experts
        router, experts, shared = self.names
        # Experts are stored as 3-D tensors (transformers >= 5: MixtralExperts, Qwen3MoeExperts, ...).
        t: list[Tensor] = [(f"{router}.weight", (e, h))]
        t += [(f"{router}.bias", (e,))] if self.router_bias else []
        t += [(f"{experts}.gate_up_proj", (e, 2 * i, h)), (f"{experts}.down_proj", (e, h, i))]
        t += (
            [(f"{experts}.gate_up_proj_bias", (e, 2 * i)), (f"{experts}.down_proj_bias", (e, h))]
            if self.expert_bias
            else []
        )
        if self.shared_size:
            t += self._dense(f"{shared}.", h, self.shared_size, False)
        return t

    def matmuls(self, h: int) -> list[tuple[str, int, int]]:
        """Projections one token runs, in forward order (an MoE token: the router, then each of its k experts'
        gate_up and down, then the shared expert)."""
        i = self.intermediate_size
        if self.act == "gelu":
            return [("c_fc", h, i), ("c_proj", i, h)]
        if not self.moe:
            if self.fused_gate_up:
                return [("gate_up_proj", h, 2 * i), ("down_proj", i, h)]
            return [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)]
        out = [("router", h, self.num_experts)]
        for _ in range(self.experts_per_token):
            out += [("expert gate_up", h, 2 * i), ("expert down", i, h)]
        if self.shared_size:
            s = self.shared_size
            out += [("shared gate_proj", h, s), ("shared up_proj", h, s), ("shared down_proj", s, h)]
        return out


@dataclass(frozen=True)
class Layer:
    """One decoder block: attention, feed-forward and the block-level norms over the hidden size."""

    attention: Attention
    mlp: Mlp
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """Block-level norms over the hidden size, by module name (Gemma 2/3 add pre/post feed-forward norms; OLMo 2
    has post-attention and post-feed-forward norms only)."""
    norm_bias: bool = False
    """LayerNorm with a bias (GPT-2); RMSNorm has none."""
    measured_kind: str = ""
    """For a model measured on fake tensors (no analytical description): the measured kind of block."""

    def tensors(self, h: int) -> list[Tensor]:
        t: list[Tensor] = [(f"{n}.weight", (h,)) for n in self.norms]
        t += [(f"{n}.bias", (h,)) for n in self.norms] if self.norm_bias else []
        t += [(f"self_attn.{n}", s) for n, s in self.attention.tensors(h)]
        return t + [(f"mlp.{n}", s) for n, s in self.mlp.tensors(h)]

    def matmuls(self, h: int) -> list[tuple[str, int, int]]:
        return self.attention.matmuls(h) + self.mlp.matmuls(h)

    def kind(self) -> str:
        """A short label: attention kind / feed-forward kind ("sliding 4096 / moe 128x top-8")."""
        at, m = self.attention, self.mlp
        if at.mla:
            attn = "mla"
        elif at.window:
            attn = f"{'chunked' if at.chunked else 'sliding'} {at.window}"
        else:
            attn = "full"
        ff = f"moe {m.num_experts}x top-{m.experts_per_token}" if m.moe else "dense"
        return f"{attn} / {ff}"


@lru_cache(maxsize=4096)
def layer_params(layer: Layer, hidden_size: int) -> int:
    """Parameters of one block."""
    return sum(math.prod(s) for _, s in layer.tensors(hidden_size))


@lru_cache(maxsize=4096)
def layer_active_params(layer: Layer, hidden_size: int) -> int:
    """Parameters one token passes through in a block: all but the routed experts it is not sent to."""
    m, h = layer.mlp, hidden_size
    if not m.moe:
        return layer_params(layer, h)
    per_expert = 3 * h * m.intermediate_size + ((2 * m.intermediate_size + h) if m.expert_bias else 0)
    return layer_params(layer, h) - (m.num_experts - m.experts_per_token) * per_expert
