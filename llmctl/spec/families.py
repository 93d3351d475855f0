"""Hugging Face config.json -> the blocks of a model, for every architecture llmctl models analytically (torch-free).

One reader per family. Each reads the config fields its transformers modeling file reads, with the defaults of its
transformers configuration class where a config.json may omit a field (transformers 5.x,
src/transformers/models/<type>/configuration_<type>.py), and returns the headline sizes and one `Layer` per block.
A new family is one function here and one entry in FAMILIES (and its presets in presets/models.yaml); the tests in
tests/spec/test_families.py build each reader's output on the meta device and compare tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmctl.errors import SpecError
from llmctl.spec.layers import Attention, Layer, Mlp

Config = dict[str, Any]


def get(cfg: Config, *names: str, default: Any = None) -> Any:
    """The first of `names` the config sets (not None), else `default`."""
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def integer(cfg: Config, *names: str, default: Any = None) -> int:
    v = get(cfg, *names, default=default)
    if v is None:
        raise KeyError(names[0])
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{names[0]} = {v!r}")
    return int(v)


MAX_LAYERS = 10_000
"""Ten times the deepest published transformer (DeepNet, Wang et al. 2022: 1,000 layers). A model of 10^9 tiny
layers stays under MAX_PARAMS but would take the engine days to build, one module at a time."""


def layer_count(cfg: Config, *names: str) -> int:
    """num_hidden_layers, refused past MAX_LAYERS before anything is built per layer."""
    n = integer(cfg, *names)
    if n > MAX_LAYERS:
        raise SpecError(f"{n:,} layers, more than {MAX_LAYERS:,}")
    return n


def _flag(cfg: Config, name: str, default: bool = False) -> bool:
    return bool(get(cfg, name, default=default))


def _rate(cfg: Config, *names: str) -> float:
    v = get(cfg, *names, default=0.0)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def layer_types(cfg: Config, n: int, default: Callable[[int], str]) -> list[str]:
    """Per-layer attention types ("full_attention", "sliding_attention", "chunked_attention"): the config's
    `layer_types` when it lists one per layer, else the family's rule."""
    lt = cfg.get("layer_types")
    if isinstance(lt, list) and len(lt) == n and all(isinstance(x, str) for x in lt):
        return list(lt)
    return [default(i) for i in range(n)]


def _headline(cfg: Config, h: int, heads: int, default_tie: bool, default_pos: int) -> dict[str, Any]:
    return {
        "hidden_size": h,
        "num_heads": heads,
        "num_kv_heads": integer(cfg, "num_key_value_heads", default=heads),
        "vocab_size": integer(cfg, "vocab_size"),
        "max_position_embeddings": integer(cfg, "max_position_embeddings", default=default_pos),
        "tie_embeddings": _flag(cfg, "tie_word_embeddings", default_tie),
        "attention_dropout": _rate(cfg, "attention_dropout"),
        "resid_dropout": _rate(cfg, "resid_pdrop"),
        "embd_dropout": _rate(cfg, "embd_pdrop"),
    }


def _windows(cfg: Config, n: int, rule: Callable[[int], str]) -> list[int]:
    w = integer(cfg, "sliding_window", default=0)
    return [w if t == "sliding_attention" else 0 for t in layer_types(cfg, n, rule)]


def _qwen_rule(cfg: Config) -> Callable[[int], str]:
    """Qwen2/Qwen3: sliding attention only with use_sliding_window, on layers from max_window_layers on."""
    use, first = _flag(cfg, "use_sliding_window"), integer(cfg, "max_window_layers", default=28)
    return lambda i: "sliding_attention" if use and cfg.get("sliding_window") and i >= first else "full_attention"


def llama_like(cfg: Config) -> dict[str, Any]:
    """Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, SmolLM3, OLMo 2, Gemma 2/3, Phi-3: a pre-norm block with
    grouped-query attention and a gated MLP or a mixture of experts."""
    mt = cfg["model_type"]
    h, heads, n = (
        integer(cfg, "hidden_size"),
        integer(cfg, "num_attention_heads"),
        layer_count(cfg, "num_hidden_layers"),
    )
    gemma = mt in ("gemma2", "gemma3_text")
    d = integer(cfg, "head_dim", default=256 if gemma else h // heads) if heads else 0
    kv = integer(cfg, "num_key_value_heads", default=heads)
    bias = _flag(cfg, "attention_bias", mt == "gpt_oss")
    # Qwen2 keeps biases on q/k/v only (Qwen2Attention: q/k/v bias=True, o_proj bias=False); Mistral's and Mixtral's
    # modules have no bias switch; Phi-3's qkv_proj has none.
    qkv_bias, o_bias = (True, False) if mt == "qwen2" else (bias, bias)
    if mt in ("mistral", "mixtral", "phi3"):
        qkv_bias = o_bias = False
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "proj"}.get(mt, "none")
    if mt == "gemma2":
        rule: Callable[[int], str] = lambda i: "sliding_attention" if i % 2 == 0 else "full_attention"  # noqa: E731
    elif mt == "gemma3_text":
        # Gemma 3: five local layers, then one global (sliding_window_pattern 6).
        p = integer(cfg, "sliding_window_pattern", default=6)
        rule = lambda i: "full_attention" if (i + 1) % p == 0 else "sliding_attention"  # noqa: E731
    elif mt == "gpt_oss":
        rule = lambda i: "sliding_attention" if i % 2 == 0 else "full_attention"  # noqa: E731
    elif mt in ("qwen2", "qwen3", "qwen3_moe", "smollm3"):
        rule = _qwen_rule(cfg) if mt != "smollm3" else (lambda i: "full_attention")
    else:  # Mistral, Mixtral, Phi-3: one sliding_window for every layer when set
        rule = lambda i: "sliding_attention" if cfg.get("sliding_window") else "full_attention"  # noqa: E731
    windows = _windows(cfg, n, rule)
    i_dense = integer(cfg, "intermediate_size")
    act = "geglu" if gemma else "swiglu"
    mlp_bias = _flag(cfg, "mlp_bias") if mt in ("llama", "smollm3") else False
    dense = Mlp(act=act, intermediate_size=i_dense, bias=mlp_bias, fused_gate_up=mt == "phi3")
    moe_at: Callable[[int], bool] = lambda i: False  # noqa: E731
    moe: Mlp | None = None
    if mt == "mixtral":
        moe = Mlp(
            act,
            i_dense,
            num_experts=integer(cfg, "num_local_experts", default=8),
            experts_per_token=integer(cfg, "num_experts_per_tok", default=2),
        )
        moe_at = lambda i: True  # noqa: E731
    elif mt == "qwen3_moe":
        e = integer(cfg, "num_experts", "num_local_experts", default=128)
        step, only = integer(cfg, "decoder_sparse_step", default=1), set(cfg.get("mlp_only_layers") or [])
        moe = Mlp(
            act,
            integer(cfg, "moe_intermediate_size", default=768),
            num_experts=e,
            experts_per_token=integer(cfg, "num_experts_per_tok", default=8),
        )
        moe_at = lambda i: i not in only and e > 0 and step > 0 and (i + 1) % step == 0  # noqa: E731
    elif mt == "gpt_oss":
        moe = Mlp(
            "swiglu-clamped",
            i_dense,
            num_experts=integer(cfg, "num_local_experts", default=128),
            experts_per_token=integer(cfg, "num_experts_per_tok", "experts_per_token", default=4),
            router_bias=True,
            expert_bias=True,
            names=("router", "experts", "shared_experts"),
        )
        moe_at = lambda i: True  # noqa: E731
    norms = ("input_layernorm", "post_attention_layernorm")
    if gemma:
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    elif mt == "olmo2":
        norms = ("post_attention_layernorm", "post_feedforward_layernorm")
    softcap_attn = mt == "gemma2" and bool(cfg.get("attn_logit_softcapping", 50.0))  # Gemma2Config's default: 50
    layers = []
    for i in range(n):
        attn = Attention(
            heads,
            kv,
            d,
            d,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            sinks=mt == "gpt_oss",
            window=windows[i],
            fused_qkv=mt == "phi3",
            softcap=softcap_attn,
        )
        layers.append(Layer(attn, moe if moe is not None and moe_at(i) else dense, norms))
    out = _headline(cfg, h, heads, default_tie=gemma or mt == "smollm3", default_pos=4096)
    softcap = get(cfg, "final_logit_softcapping", default=30.0 if mt == "gemma2" else 0.0)
    return {**out, "layers": tuple(layers), "final_logit_softcapping": float(softcap or 0.0)}


def llama4_text(cfg: Config) -> dict[str, Any]:
    """Llama 4 text: MoE blocks (routed experts + one shared expert) interleaved with dense ones (Maverick), chunked
    attention on the rotary layers and full attention without rotary every fourth layer (iRoPE)."""
    h, heads, n = (
        integer(cfg, "hidden_size"),
        integer(cfg, "num_attention_heads"),
        layer_count(cfg, "num_hidden_layers"),
    )
    d = integer(cfg, "head_dim", default=h // heads)
    kv = integer(cfg, "num_key_value_heads", default=heads)
    step = integer(cfg, "interleave_moe_layer_step", default=1)
    moe_layers = cfg.get("moe_layers")
    moe_set = set(moe_layers) if isinstance(moe_layers, list) else set(range(step - 1, n, step)) if step > 0 else set()
    nope = cfg.get("no_rope_layers")
    if not (isinstance(nope, list) and len(nope) == n):
        nope = [int((i + 1) % 4 != 0) for i in range(n)]  # Llama4TextConfig: 1 = rotary layer
    chunk = integer(cfg, "attention_chunk_size", default=8192)
    types = layer_types(cfg, n, lambda i: "chunked_attention" if nope[i] else "full_attention")
    bias, qk_l2 = _flag(cfg, "attention_bias"), _flag(cfg, "use_qk_norm", True)
    i_exp = integer(cfg, "intermediate_size")
    moe = Mlp(
        "swiglu",
        i_exp,
        num_experts=integer(cfg, "num_local_experts", default=16),
        experts_per_token=integer(cfg, "num_experts_per_tok", default=1),
        shared_size=i_exp,
        names=("router", "experts", "shared_expert"),
    )
    dense = Mlp("swiglu", integer(cfg, "intermediate_size_mlp", default=16384))
    layers = []
    for i in range(n):
        chunked = types[i] == "chunked_attention"
        attn = Attention(
            heads,
            kv,
            d,
            d,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="l2" if qk_l2 and nope[i] else "none",
            window=chunk if chunked else 0,
            chunked=chunked,
        )
        layers.append(Layer(attn, moe if i in moe_set else dense))
    return {**_headline(cfg, h, heads, default_tie=False, default_pos=131072), "layers": tuple(layers)}


def deepseek_v3(cfg: Config) -> dict[str, Any]:
    """DeepSeek-V3 / R1 (and Kimi K2): multi-head latent attention; the first `first_k_dense_replace` blocks dense,
    the rest routed experts plus shared experts (DeepSeek-V3 technical report, arXiv:2412.19437, section 2)."""
    h, heads, n = (
        integer(cfg, "hidden_size"),
        integer(cfg, "num_attention_heads"),
        layer_count(cfg, "num_hidden_layers"),
    )
    nope, rope = integer(cfg, "qk_nope_head_dim", default=128), integer(cfg, "qk_rope_head_dim", default=64)
    dv = integer(cfg, "v_head_dim", default=128)
    q_rank = get(cfg, "q_lora_rank", default=None) if "q_lora_rank" in cfg else 1536
    bias = _flag(cfg, "attention_bias")
    attn = Attention(
        heads,
        heads,
        nope + rope,
        dv,
        qkv_bias=bias,
        o_bias=bias,
        q_lora_rank=int(q_rank or 0),
        kv_lora_rank=integer(cfg, "kv_lora_rank", default=512),
        rope_dim=rope,
    )
    moe_i = integer(cfg, "moe_intermediate_size", default=2048)
    moe = Mlp(
        "swiglu",
        moe_i,
        num_experts=integer(cfg, "n_routed_experts", default=256),
        experts_per_token=integer(cfg, "num_experts_per_tok", default=8),
        shared_size=moe_i * integer(cfg, "n_shared_experts", default=1),
    )
    dense = Mlp("swiglu", integer(cfg, "intermediate_size", default=18432))
    first = integer(cfg, "first_k_dense_replace", default=3)
    layers = tuple(Layer(attn, dense if i < first else moe) for i in range(n))
    out = _headline(cfg, h, heads, default_tie=False, default_pos=4096)
    return {**out, "num_kv_heads": heads, "layers": layers}


def gpt2(cfg: Config) -> dict[str, Any]:
    """GPT-2: LayerNorms with biases, one c_attn (Conv1D) for q/k/v, a GELU MLP, learned positions, tied head."""
    h = integer(cfg, "n_embd", "hidden_size")
    heads, n = integer(cfg, "n_head", "num_attention_heads"), layer_count(cfg, "n_layer", "num_hidden_layers")
    d = h // heads
    attn = Attention(heads, heads, d, d, qkv_bias=True, o_bias=True, fused_qkv=True)
    layer = Layer(
        attn, Mlp("gelu", integer(cfg, "n_inner", default=4 * h), bias=True), ("ln_1", "ln_2"), norm_bias=True
    )
    return {
        "hidden_size": h,
        "num_heads": heads,
        "num_kv_heads": heads,
        "vocab_size": integer(cfg, "vocab_size"),
        "max_position_embeddings": integer(cfg, "n_positions", "max_position_embeddings", default=1024),
        "tie_embeddings": _flag(cfg, "tie_word_embeddings", True),
        # GPT2Config's defaults: 0.1 each (attn_pdrop, resid_pdrop, embd_pdrop).
        "attention_dropout": float(get(cfg, "attn_pdrop", default=0.1)),
        "resid_dropout": float(get(cfg, "resid_pdrop", default=0.1)),
        "embd_dropout": float(get(cfg, "embd_pdrop", default=0.1)),
        "layers": tuple(layer for _ in range(n)),
    }


FAMILIES: dict[str, Callable[[Config], dict[str, Any]]] = {
    **{
        t: llama_like
        for t in (
            *("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "smollm3"),
            *("olmo2", "gemma2", "gemma3_text", "phi3", "gpt_oss"),
        )
    },
    "llama4_text": llama4_text,
    "deepseek_v3": deepseek_v3,
    "gpt2": gpt2,
}
"""model_type -> reader. Everything else is measured on fake tensors (llmctl.measure.fake) when torch is
installed."""

ANALYTICAL_MODEL_TYPES = sorted(FAMILIES)


def read_family(cfg: Config, name: str) -> dict[str, Any]:
    """ModelSpec fields of an analytical family's config (raises SpecError naming the field on bad input)."""
    mt = cfg["model_type"]
    try:
        out = FAMILIES[mt](cfg)
    except SpecError as e:
        raise SpecError(f"{name}: {e.message}", hint=e.hint) from None
    except KeyError as e:
        raise SpecError(f"{name}: missing field {e.args[0]!r} for model_type {mt!r}") from None
    except ZeroDivisionError:  # head_dim = hidden // heads, before ModelSpec can say that heads must be positive
        raise SpecError(f"{name}: num_attention_heads (n_head) must be positive, got 0") from None
    except (TypeError, ValueError, OverflowError) as e:  # int(None), int("x"), int(float("inf")) (JSON's Infinity)
        raise SpecError(f"{name}: a size field is not an integer ({e})") from None
    return out
