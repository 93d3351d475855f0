"""ModelSpec: the numbers of a decoder-only transformer that decide memory and FLOPs (torch-free).

A spec comes from a shipped preset (presets/models.yaml), a local Hugging Face config.json (file or folder), or a
raw parameter count (`7B`, with an assumed Llama-style shape). Parameter counts are computed tensor by tensor, the
way transformers lays the modules out, so that they equal what transformers instantiates (tests check this on the
meta device for every preset).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from llmctl.errors import SpecError, UnknownNameError, suggest
from llmctl.fileio import load_json

# model_type values whose module layout we know. Llama-style: RMSNorm, SwiGLU MLP, RoPE, optional GQA.
LLAMA_STYLE = {"llama", "mistral", "qwen2", "mixtral"}
GPT2_STYLE = {"gpt2"}
SUPPORTED_MODEL_TYPES = sorted(LLAMA_STYLE | GPT2_STYLE)

Tensor = tuple[str, tuple[int, ...]]

MAX_LAYERS = 10_000
"""Ten times the deepest published transformer (DeepNet, Wang et al. 2022: 1,000 layers). A model of 10^9 tiny
layers stays under MAX_PARAMS but would take the engine days to build, one module at a time."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by the shapes that decide memory and compute."""

    name: str
    model_type: str
    """Hugging Face `model_type` (llama, mistral, mixtral, qwen2, gpt2)."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads: equal to num_heads for multi-head attention, fewer for GQA."""
    head_dim: int
    intermediate_size: int
    """MLP inner size (per expert for MoE)."""
    vocab_size: int
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool = False
    num_experts: int = 0
    """0 for a dense MLP; E routed experts for MoE (Mixtral)."""
    experts_per_token: int = 0
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The Hugging Face config fields this spec came from (used by the engine to build the model)."""
    params_override: int | None = None
    """Set for `--params 7B`: the stated count wins over the assumed shape's count."""
    source: str = "preset"

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise SpecError(f"model {self.name!r}: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"model {self.name!r}: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_layers > MAX_LAYERS:
            raise SpecError(f"model {self.name!r}: {self.num_layers:,} layers, more than {MAX_LAYERS:,}")
        # What transformers refuses or crashes on when it builds the model (the engine would fail after torch starts):
        # RoPE rotates pairs of dimensions, so a Llama-style head_dim is even; LlamaConfig and GPT-2's attention
        # split hidden_size into num_heads equal heads.
        if self.model_type in LLAMA_STYLE and self.head_dim % 2:
            raise SpecError(f"model {self.name!r}: head_dim {self.head_dim} is odd (rotary embeddings need it even)")
        if self.model_type in {"llama"} | GPT2_STYLE and self.hidden_size % self.num_heads:
            raise SpecError(
                f"model {self.name!r}: hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_heads})"
            )

    @property
    def is_gpt2(self) -> bool:
        return self.model_type in GPT2_STYLE

    @property
    def mlp_kind(self) -> str:
        return "gelu" if self.is_gpt2 else "swiglu"

    @property
    def norm_kind(self) -> str:
        return "layernorm" if self.is_gpt2 else "rmsnorm"

    # --- tensors, the way transformers lays them out -------------------------------------------------------
    def layer_tensors(self) -> list[Tensor]:
        """Parameter tensors of one decoder block."""
        h, d, a, kv, i = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, self.intermediate_size
        if self.is_gpt2:
            # GPT2Block: Conv1D layers store (in, out) weights; every Conv1D and LayerNorm has a bias.
            return [
                ("ln_1.weight", (h,)),
                ("ln_1.bias", (h,)),
                ("attn.c_attn.weight", (h, 3 * h)),
                ("attn.c_attn.bias", (3 * h,)),
                ("attn.c_proj.weight", (h, h)),
                ("attn.c_proj.bias", (h,)),
                ("ln_2.weight", (h,)),
                ("ln_2.bias", (h,)),
                ("mlp.c_fc.weight", (h, i)),
                ("mlp.c_fc.bias", (i,)),
                ("mlp.c_proj.weight", (i, h)),
                ("mlp.c_proj.bias", (h,)),
            ]
        t: list[Tensor] = [
            ("input_layernorm.weight", (h,)),
            ("self_attn.q_proj.weight", (a * d, h)),
            ("self_attn.k_proj.weight", (kv * d, h)),
            ("self_attn.v_proj.weight", (kv * d, h)),
            ("self_attn.o_proj.weight", (h, a * d)),
            ("post_attention_layernorm.weight", (h,)),
        ]
        if self.qkv_bias:  # Qwen2 keeps biases on q/k/v only
            t += [
                ("self_attn.q_proj.bias", (a * d,)),
                ("self_attn.k_proj.bias", (kv * d,)),
                ("self_attn.v_proj.bias", (kv * d,)),
            ]
        if self.num_experts:
            e = self.num_experts
            t.append(("mlp.gate.weight", (e, h)))  # router, no bias
            t += [("mlp.experts.gate_up_proj", (e, 2 * i, h)), ("mlp.experts.down_proj", (e, h, i))]
        else:
            t += [("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)), ("mlp.down_proj.weight", (h, i))]
        return t

    def embedding_tensors(self) -> list[Tensor]:
        h = self.hidden_size
        t: list[Tensor] = [("embed_tokens.weight", (self.vocab_size, h))]
        if self.is_gpt2:
            t.append(("wpe.weight", (self.max_position_embeddings, h)))
        return t

    def head_tensors(self) -> list[Tensor]:
        """Final norm and (untied) LM head."""
        h = self.hidden_size
        t: list[Tensor] = [("norm.weight", (h,))] + ([("norm.bias", (h,))] if self.is_gpt2 else [])
        if not self.tie_embeddings:
            t.append(("lm_head.weight", (self.vocab_size, h)))
        return t

    # Cached on the instance (a frozen dataclass: the fields never change; `replace` makes a new instance): the
    # planner asks for these thousands of times per plan.
    @cached_property
    def params_per_layer(self) -> int:
        return sum(math.prod(s) for _, s in self.layer_tensors())

    @cached_property
    def embedding_params(self) -> int:
        return sum(math.prod(s) for _, s in self.embedding_tensors())

    @cached_property
    def head_params(self) -> int:
        return sum(math.prod(s) for _, s in self.head_tensors())

    @cached_property
    def shape_params(self) -> int:
        """Exact parameter count of the described shape."""
        return self.embedding_params + self.num_layers * self.params_per_layer + self.head_params

    @cached_property
    def params(self) -> int:
        """Parameter count used everywhere (the stated count for `--params`, else the shape's exact count)."""
        return self.params_override if self.params_override is not None else self.shape_params

    @cached_property
    def active_params_per_token(self) -> int:
        """Parameters a token passes through (MoE: only the routed experts), for FLOPs."""
        if not self.num_experts:
            return self.params
        expert = 3 * self.hidden_size * self.intermediate_size
        idle = (self.num_experts - self.experts_per_token) * expert * self.num_layers
        return self.params - idle

    def describe(self) -> str:
        gqa = f", {self.num_kv_heads} kv heads" if self.num_kv_heads != self.num_heads else ""
        moe = f", {self.num_experts} experts (top-{self.experts_per_token})" if self.num_experts else ""
        return (
            f"{self.model_type}: {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads"
            f"{gqa}, {self.mlp_kind} MLP {self.intermediate_size}{moe}, vocab {self.vocab_size}"
            f"{', tied embeddings' if self.tie_embeddings else ''}"
        )


# --- construction ----------------------------------------------------------------------------------------------
def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


SIZE_FIELDS = (
    *("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
    *("head_dim", "vocab_size", "max_position_embeddings", "num_local_experts", "num_experts_per_tok"),
    *("n_embd", "n_head", "n_layer", "n_inner", "n_positions"),
)
"""The Hugging Face config fields `from_hf_config` reads as integer sizes (transformers sizes tensors with them)."""


def from_hf_config(cfg: dict[str, Any], name: str = "config", source: str = "config") -> ModelSpec:
    """Build a spec from a Hugging Face config dict (config.json contents)."""
    if not isinstance(cfg, dict):
        raise SpecError(f"{name}: a config must be a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt is None:
        raise SpecError(f"{name}: no 'model_type' field", hint="is this a Hugging Face config.json?")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise SpecError(
            f"{name}: model_type {mt!r} is not supported", hint="supported: " + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    try:
        if mt in GPT2_STYLE:
            h = int(_get(cfg, "n_embd", "hidden_size"))
            heads = int(_get(cfg, "n_head", "num_attention_heads"))
            spec = ModelSpec(
                name=name,
                model_type=mt,
                num_layers=int(_get(cfg, "n_layer", "num_hidden_layers")),
                hidden_size=h,
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=h // heads,
                intermediate_size=int(_get(cfg, "n_inner", default=4 * h)),
                vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(_get(cfg, "n_positions", "max_position_embeddings", default=1024)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                hf_config=dict(cfg),
                source=source,
            )
        else:
            h = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            spec = ModelSpec(
                name=name,
                model_type=mt,
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=h,
                num_heads=heads,
                num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
                head_dim=int(_get(cfg, "head_dim", default=h // heads)),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(_get(cfg, "max_position_embeddings", default=4096)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=(mt == "qwen2") or bool(cfg.get("attention_bias", False)),
                num_experts=int(_get(cfg, "num_local_experts", default=0)) if mt == "mixtral" else 0,
                experts_per_token=int(_get(cfg, "num_experts_per_tok", default=0)) if mt == "mixtral" else 0,
                hf_config=dict(cfg),
                source=source,
            )
    except KeyError as e:
        raise SpecError(f"{name}: missing field {e.args[0]!r} for model_type {mt!r}") from None
    except ZeroDivisionError:  # head_dim = hidden // heads, before ModelSpec can say that heads must be positive
        raise SpecError(f"{name}: num_attention_heads (n_head) must be positive, got 0") from None
    except (TypeError, ValueError, OverflowError) as e:  # int(None), int("x"), int(float("inf")) (JSON's Infinity)
        raise SpecError(f"{name}: a size field is not an integer ({e})") from None
    if mt not in GPT2_STYLE and cfg.get("mlp_bias"):
        raise SpecError(f"{name}: mlp_bias=true is not supported yet")
    return spec


@lru_cache(maxsize=1)
def _preset_entries() -> tuple[dict[str, Any], ...]:
    text = resources.files("llmctl.spec").joinpath("presets/models.yaml").read_text()
    return tuple(yaml.safe_load(text))


def preset_names() -> list[str]:
    return [e["name"] for e in _preset_entries()]


def preset_entry(name: str) -> dict[str, Any]:
    for e in _preset_entries():
        if e["name"].lower() == name.lower() or e.get("hf_id", "").lower() == name.lower():
            return e
    raise UnknownNameError(
        f"unknown model {name!r}",
        hint=suggest(name, preset_names())
        or "see `llmctl estimate-memory --list-models`, or pass a config.json path or --params",
    )


def from_preset(name: str) -> ModelSpec:
    e = preset_entry(name)
    return from_hf_config(e["config"], name=e["name"], source="preset")


def from_config_path(path: str | Path) -> ModelSpec:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    cfg = load_json(p, "config.json")
    if not isinstance(cfg, dict):
        raise SpecError(f"{p}: a config.json is a JSON object (model_type, hidden_size, ...)")
    return from_hf_config(cfg, name=str(path), source="config")


_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


# Past these no real model goes: the largest published models have ~2T parameters and were trained on ~36T tokens
# (Qwen3, https://arxiv.org/abs/2505.09388); a count beyond them is a typo, refused with one line.
MAX_PARAMS = 10**14
MAX_TOKENS = 10**15


def parse_count(text: str, what: str = "parameter count", limit: int = MAX_PARAMS) -> int:
    """'7B' -> 7_000_000_000; '1.5e9', '350M', '124439808' also work. `what` names the value in errors; more than
    `limit` is refused."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not m:
        raise SpecError(f"cannot read {what} {text!r}", hint="use a number like 7B, 350M or 1.3e9")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value > limit:
        raise SpecError(f"{what} {text!r} is out of range: at most {limit:.0e}")
    n = int(round(value))
    if n <= 0:
        raise SpecError(f"{what} must be positive, got {text!r}")
    return n


def from_param_count(count: int | str, vocab_size: int = 32000) -> ModelSpec:
    """An assumed Llama-style shape for a raw parameter count.

    The shape follows the Llama-2 family: head_dim 128, hidden = 128 * layers (aspect ratio of 7B/13B),
    SwiGLU intermediate = 8/3 * hidden rounded up to 256, vocabulary 32000. The shape only decides activations;
    model states use the stated count. The shape is reported in the output.
    """
    n = parse_count(count) if isinstance(count, str) else int(count)
    best: ModelSpec | None = None
    for layers in range(1, 257):
        h = 128 * layers
        i = 256 * math.ceil(8 * h / 3 / 256)
        cand = ModelSpec(
            name=f"{n / 1e9:.3g}B (assumed shape)",
            model_type="llama",
            num_layers=layers,
            hidden_size=h,
            num_heads=h // 128,
            num_kv_heads=h // 128,
            head_dim=128,
            intermediate_size=i,
            vocab_size=vocab_size,
            max_position_embeddings=4096,
            tie_embeddings=False,
            params_override=n,
            source="params",
        )
        if best is None or abs(cand.shape_params - n) < abs(best.shape_params - n):
            best = cand
        if cand.shape_params > n:
            break
    assert best is not None
    return best


def resolve_model(name: str | None = None, params: str | None = None) -> ModelSpec:
    """MODEL argument -> spec: a preset name, an HF id of a preset, a config.json file or folder, or --params."""
    if params is not None:
        if name:
            raise SpecError("give either a MODEL or --params, not both")
        return from_param_count(params)
    if not name:
        raise SpecError("no model given", hint="pass a preset name, a config.json path, or --params 7B")
    p = Path(name)
    if p.suffix == ".json" or p.is_dir() or p.is_file():
        return from_config_path(p)
    return from_preset(name)
