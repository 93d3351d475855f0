"""The pre-norm decoder block most families share (Llama's: grouped-query rotary attention, a gated MLP or a mixture
of experts), read from a config with the family's own `Traits` (torch-free). Llama, Mistral, Mixtral, Qwen2/3,
Qwen3-MoE, SmolLM3, OLMo 2, Gemma 2/3, Phi-3 and gpt-oss read their blocks here; each family module says how its
modeling file differs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmctl.families.base import Config, flag, get, headline, integer, layer_count, windows
from llmctl.spec.layers import Attention, Layer, Mlp

Rule = Callable[[int], str]
"""Layer index -> its attention type (full_attention, sliding_attention)."""
MoeLayout = Callable[[Config, str, int], tuple[Mlp | None, Callable[[int], bool]]]
"""(config, activation, dense width) -> (the MoE block, which layers have it)."""


def uniform_window(cfg: Config) -> Rule:
    """Mistral, Mixtral, Phi-3, Llama: one sliding_window for every layer when the config sets one."""
    return lambda i: "sliding_attention" if cfg.get("sliding_window") else "full_attention"


def alternate(cfg: Config) -> Rule:
    """Gemma 2, gpt-oss: sliding and full attention alternate, the first layer sliding."""
    return lambda i: "sliding_attention" if i % 2 == 0 else "full_attention"


def no_moe(cfg: Config, act: str, width: int) -> tuple[Mlp | None, Callable[[int], bool]]:
    return None, lambda i: False


@dataclass(frozen=True)
class Traits:
    """How a family's modeling file differs from Llama's, for the config reader."""

    layer_rule: Callable[[Config], Rule] = uniform_window
    act: str = "swiglu"
    """swiglu, or geglu (Gemma)."""
    head_dim_default: int | None = None
    """head_dim when the config has none (None: hidden // heads; Gemma: 256)."""
    attention_bias_default: bool = False
    """attention_bias when the config has none (gpt-oss: True)."""
    attention_bias: str = "config"
    """config: q/k/v and o take the config's attention_bias; qkv_only: q/k/v biases, no o bias (Qwen2Attention);
    none: no bias switch in the module (Mistral, Mixtral, Phi-3)."""
    mlp_bias_field: bool = False
    """The MLP reads the config's mlp_bias (LlamaMLP, SmolLM3); else it has no bias."""
    qk_norm: str = "none"
    """none, head (RMSNorm per head: Qwen3, Gemma 3), proj (over the projection: OLMo 2)."""
    fused: bool = False
    """Phi-3: one qkv_proj and one gate_up_proj."""
    moe: MoeLayout = no_moe
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    softcap_default: float | None = None
    """Gemma 2: attention logits soft-capped (attn_logit_softcapping, default 50) and the final logits too
    (final_logit_softcapping, default 30)."""
    sinks: bool = False
    """gpt-oss: one learned sink logit per head."""
    tie_default: bool = False


def read_gated(cfg: Config, t: Traits) -> dict[str, Any]:
    """ModelSpec fields of a gated pre-norm decoder with the family's traits."""
    h, heads, n = (
        integer(cfg, "hidden_size"),
        integer(cfg, "num_attention_heads"),
        layer_count(cfg, "num_hidden_layers"),
    )
    d = integer(cfg, "head_dim", default=t.head_dim_default or h // heads) if heads else 0
    kv = integer(cfg, "num_key_value_heads", default=heads)
    bias = flag(cfg, "attention_bias", t.attention_bias_default)
    qkv_bias, o_bias = {"config": (bias, bias), "qkv_only": (True, False), "none": (False, False)}[t.attention_bias]
    layer_windows = windows(cfg, n, t.layer_rule(cfg))
    i_dense = integer(cfg, "intermediate_size")
    mlp_bias = flag(cfg, "mlp_bias") if t.mlp_bias_field else False
    dense = Mlp(act=t.act, intermediate_size=i_dense, bias=mlp_bias, fused_gate_up=t.fused)
    moe, moe_at = t.moe(cfg, t.act, i_dense)
    softcap_attn = t.softcap_default is not None and bool(cfg.get("attn_logit_softcapping", 50.0))
    layers = []
    for i in range(n):
        attn = Attention(
            heads,
            kv,
            d,
            d,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=t.qk_norm,
            sinks=t.sinks,
            window=layer_windows[i],
            fused_qkv=t.fused,
            softcap=softcap_attn,
        )
        layers.append(Layer(attn, moe if moe is not None and moe_at(i) else dense, t.norms))
    out = headline(cfg, h, heads, default_tie=t.tie_default, default_pos=4096)
    softcap = get(cfg, "final_logit_softcapping", default=t.softcap_default or 0.0)
    return {**out, "layers": tuple(layers), "final_logit_softcapping": float(softcap or 0.0)}
