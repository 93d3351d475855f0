"""ModelSpec: the numbers of a decoder-only transformer that decide memory and FLOPs (torch-free).

A spec comes from a shipped preset (presets/models.yaml), a local Hugging Face config.json (file or folder), or a
raw parameter count (`7B`, with an assumed Llama-style shape). Parameter counts are computed tensor by tensor, the
way transformers lays the modules out, so that they equal what transformers instantiates (tests check this on the
meta device for every preset).
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from llmctl.errors import SpecError, UnknownNameError, suggest
from llmctl.fileio import load_json
from llmctl.spec import attention as attn
from llmctl.spec.layers import MAX_LAYERS, Attention, Layer, Mlp, layer_active_params, layer_params

if TYPE_CHECKING:
    from llmctl.families import Family, Features


Tensor = tuple[str, tuple[int, ...]]

"""A model_type outside the families (measured on fake tensors) is read as a Llama-like block where a feature is
asked for."""


def analytical_model_types() -> list[str]:
    """The model_types llmctl models analytically (llmctl.families)."""
    from llmctl.families import ANALYTICAL_MODEL_TYPES

    return ANALYTICAL_MODEL_TYPES


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by the shapes that decide memory and compute.

    The headline sizes (hidden, heads, the first block's head_dim and MLP width) describe the model; `layers`
    describes every block (they differ: sliding/global attention, dense/MoE feed-forwards) and decides the counts."""

    name: str
    model_type: str
    """Hugging Face `model_type` (llama, qwen3, gemma3_text, deepseek_v3, gpt_oss, ...)."""
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
    """0 for a dense MLP; E routed experts for MoE (the first MoE block's)."""
    experts_per_token: int = 0
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The Hugging Face config fields this spec came from (used by the engine to build the model)."""
    params_override: int | None = None
    """Set for `--params 7B`: the stated count wins over the assumed shape's count."""
    source: str = "preset"
    layers: tuple[Layer, ...] = ()
    """One entry per block; built from the headline sizes (a uniform Llama or GPT-2 stack) when empty."""
    final_logit_softcapping: float = 0.0
    """Gemma 2: logits = c * tanh(logits / c) (0: none)."""
    attention_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    measured: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """For architectures outside the analytical families: what llmctl.measure.fake measured (params, and the
    bytes each kind of block saves for backward)."""

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
        if not self.layers:
            object.__setattr__(self, "layers", tuple(self._uniform_layer() for _ in range(self.num_layers)))
        elif len(self.layers) != self.num_layers and len(set(self.layers)) == 1:
            # `replace(spec, num_layers=n)` on a uniform stack: a what-if depth of the same block.
            object.__setattr__(self, "layers", (self.layers[0],) * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise SpecError(f"model {self.name!r}: {len(self.layers)} block descriptions for {self.num_layers} layers")
        for layer in set(self.layers):
            at, m = layer.attention, layer.mlp
            for what, v in (
                ("head_dim", at.head_dim),
                ("v_head_dim", at.v_head_dim),
                ("MLP width", m.intermediate_size),
            ):
                if v <= 0:
                    raise SpecError(f"model {self.name!r}: {what} must be positive, got {v}")
            if m.moe and not 0 < m.experts_per_token <= m.num_experts:
                raise SpecError(
                    f"model {self.name!r}: {m.experts_per_token} experts per token out of {m.num_experts} routed"
                )
            # What transformers refuses or crashes on when it builds the model (the engine would fail after torch
            # starts): RoPE rotates pairs of dimensions, so a rotary head_dim (MLA: its rotary part) is even.
            rot = at.rope_dim if at.mla else at.head_dim
            if self.family is not None and self.features.rotary and rot % 2:
                raise SpecError(f"model {self.name!r}: head_dim {rot} is odd (rotary embeddings need it even)")
        # LlamaConfig and GPT-2's attention split hidden_size into num_heads equal heads.
        if self.family is not None and self.features.heads_split_hidden and self.hidden_size % self.num_heads:
            raise SpecError(
                f"model {self.name!r}: hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_heads})"
            )

    def _uniform_layer(self) -> Layer:
        h, a, d = self.hidden_size, self.num_heads, self.head_dim
        if self.is_gpt2:
            attn = Attention(a, a, d, d, qkv_bias=True, o_bias=True, fused_qkv=True)
            return Layer(attn, Mlp("gelu", self.intermediate_size, bias=True), ("ln_1", "ln_2"), norm_bias=True)
        attn = Attention(a, self.num_kv_heads, d, d, qkv_bias=self.qkv_bias)
        mlp = Mlp(
            "swiglu", self.intermediate_size, num_experts=self.num_experts, experts_per_token=self.experts_per_token
        )
        del h
        return Layer(attn, mlp)

    @cached_property
    def family(self) -> Family | None:
        """The analytical family entry of this model_type (None: measured on fake tensors, or a bare count). The
        families are asked here, not imported with this module: they build their layers from llmctl.spec.layers."""
        from llmctl.families import family_of

        return family_of(self.model_type)

    @cached_property
    def features(self) -> Features:
        from llmctl.families import Features

        fam = self.family
        return fam.features if fam is not None else Features()

    @property
    def is_gpt2(self) -> bool:
        return self.features.block == "gpt2"

    @property
    def layer_norms(self) -> bool:
        """The family's norms are LayerNorms with biases (GPT-2's): each keeps its input, mean and rstd for backward,
        frozen or not, where an RMSNorm keeps an fp32 input, an rsqrt and (for its weight) its output."""
        return self.features.norm == "layernorm"

    @property
    def mlp_kind(self) -> str:
        return self.layers[0].mlp.act

    @cached_property
    def layer_groups(self) -> tuple[tuple[Layer, int], ...]:
        """Distinct blocks and how many of each, in order of first appearance."""
        counts: dict[Layer, int] = {}
        for layer in self.layers:
            counts[layer] = counts.get(layer, 0) + 1
        return tuple(counts.items())

    def groups_of(self, blocks: Iterable[int] | None) -> tuple[tuple[Layer, int], ...]:
        """`layer_groups` of some blocks only (a pipeline rank's), or of all of them (None)."""
        if blocks is None:
            return self.layer_groups
        counts: dict[Layer, int] = {}
        for i in blocks:
            counts[self.layers[i]] = counts.get(self.layers[i], 0) + 1
        return tuple(counts.items())

    @property
    def moe(self) -> bool:
        return any(layer.mlp.moe for layer in self.layers)

    def runs_kernel(self, kernel: str) -> bool:
        """Whether transformers builds this model with that attention kernel (eager always). Gemma 2 (soft-capped
        attention logits) and gpt-oss (attention sinks) declare no SDPA path (`_supports_sdpa = False`); Llama 4
        text no flash-attention one; a measured model has no SDPA path when transformers built it eager."""
        kind = attn.Attention(kernel)
        if kind is attn.Attention.SDPA:
            if self.measured is not None:
                return self.measured.get("attention_used", {}).get(kind, kind) == kind
            return not any(layer.attention.softcap or layer.attention.sinks for layer in self.layers)
        if kind is attn.Attention.FLASH:
            return self.features.flash_attention
        return True

    def attention_kernel(self, requested: str) -> attn.Attention:
        """The kernel the engine runs for `requested` (eager, sdpa, flash): it, or the next one down (flash, sdpa,
        eager) that this model has, as llmctl.engine.model.fit_attention falls back."""
        kernel = attn.attention(requested)
        while not self.runs_kernel(kernel):
            kernel = attn.FALLBACK[kernel]
        return kernel

    # --- tensors, the way transformers lays them out -------------------------------------------------------
    def layer_tensors(self, index: int = 0) -> list[Tensor]:
        """Parameter tensors of one decoder block (the first by default)."""
        return self.block_tensors(self.layers[index])

    def block_tensors(self, layer: Layer) -> list[Tensor]:
        """Parameter tensors of a decoder block as transformers lays them out: names and shapes of its modules."""
        if self.features.conv1d:
            # GPT2Block: Conv1D layers store (in, out) weights; every Conv1D and LayerNorm has a bias.
            h, i = self.hidden_size, layer.mlp.intermediate_size
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
        return layer.tensors(self.hidden_size)

    def embedding_tensors(self) -> list[Tensor]:
        h = self.hidden_size
        t: list[Tensor] = [("embed_tokens.weight", (self.vocab_size, h))]
        if self.features.learned_positions:
            t.append(("wpe.weight", (self.max_position_embeddings, h)))
        return t

    def head_tensors(self) -> list[Tensor]:
        """Final norm and (untied) LM head."""
        h = self.hidden_size
        t: list[Tensor] = [("norm.weight", (h,))] + ([("norm.bias", (h,))] if self.layer_norms else [])
        if not self.tie_embeddings:
            t.append(("lm_head.weight", (self.vocab_size, h)))
        return t

    # Cached on the instance (a frozen dataclass: the fields never change; `replace` makes a new instance): the
    # planner asks for these thousands of times per plan.
    def params_of(self, layer: Layer) -> int:
        """Parameters of one block."""
        if self.measured is not None:
            return self._measured_layer(layer)["params"]
        return layer_params(layer, self.hidden_size)

    def active_params_of(self, layer: Layer) -> int:
        if self.measured is not None:
            entry = self._measured_layer(layer)
            return entry.get("active_params", entry["params"])
        return layer_active_params(layer, self.hidden_size)

    def _measured_layer(self, layer: Layer) -> dict[str, Any]:
        return self.measured_kinds[layer]

    @cached_property
    def measured_kinds(self) -> dict[Layer, dict[str, Any]]:
        """Measured specs: block -> its measured entry (by the block's measured_kind)."""
        assert self.measured is not None
        by_kind = {k["kind"]: k for k in self.measured["layers"]}
        return {layer: by_kind[layer.measured_kind] for layer in set(self.layers)}

    @cached_property
    def params_per_layer(self) -> int:
        """Parameters of the largest block (what FSDP gathers at once)."""
        return max(self.params_of(layer) for layer, _ in self.layer_groups)

    @cached_property
    def layers_params(self) -> int:
        return sum(n * self.params_of(layer) for layer, n in self.layer_groups)

    @cached_property
    def embedding_params(self) -> int:
        if self.measured is not None:
            return int(self.measured["embedding_params"])
        return sum(math.prod(s) for _, s in self.embedding_tensors())

    @cached_property
    def head_params(self) -> int:
        if self.measured is not None:
            return int(self.measured["head_params"])
        return sum(math.prod(s) for _, s in self.head_tensors())

    @cached_property
    def shape_params(self) -> int:
        """Exact parameter count of the described shape."""
        return self.embedding_params + self.layers_params + self.head_params

    @cached_property
    def params(self) -> int:
        """Parameter count used everywhere (the stated count for `--params`, else the shape's exact count)."""
        return self.params_override if self.params_override is not None else self.shape_params

    @cached_property
    def active_params_per_token(self) -> int:
        """Parameters a token passes through (MoE: only the routed experts it is sent to, and shared experts)."""
        idle = sum(n * (self.params_of(layer) - self.active_params_of(layer)) for layer, n in self.layer_groups)
        return self.params - idle

    def describe(self) -> str:
        if self.measured is not None:
            kinds = len(self.measured["layers"])
            return (
                f"{self.model_type}: {self.num_layers} layers ({kinds} kind{'s' if kinds > 1 else ''}), hidden "
                f"{self.hidden_size}, vocab {self.vocab_size} (measured on fake tensors)"
            )
        at = self.layers[0].attention
        if at.mla:
            attn = f", MLA (kv rank {at.kv_lora_rank}, q rank {at.q_lora_rank or '-'})"
        elif self.num_kv_heads != self.num_heads:
            attn = f", {self.num_kv_heads} kv heads"
        else:
            attn = ""
        if self.head_dim * self.num_heads != self.hidden_size and not at.mla:
            attn += f", head_dim {self.head_dim}"
        windows = sorted({layer.attention.window for layer in self.layers if layer.attention.window})
        if windows:
            local = sum(1 for layer in self.layers if layer.attention.window)
            kind = (
                "chunked"
                if self.layers[[la.attention.window > 0 for la in self.layers].index(True)].attention.chunked
                else "sliding"
            )
            attn += f", {local}/{self.num_layers} {kind} {'/'.join(map(str, windows))}"
        moe_layers = [la.mlp for la in self.layers if la.mlp.moe]
        moe = ""
        if moe_layers:
            m = moe_layers[0]
            shared = f" + shared {m.shared_size}" if m.shared_size else ""
            where = "" if len(moe_layers) == self.num_layers else f" in {len(moe_layers)}/{self.num_layers} layers"
            moe = f", {m.num_experts} experts x {m.intermediate_size} (top-{m.experts_per_token}){shared}{where}"
        return (
            f"{self.model_type}: {self.num_layers} layers, hidden {self.hidden_size}, {self.num_heads} heads"
            f"{attn}, {self.mlp_kind} MLP {self.intermediate_size}{moe}, vocab {self.vocab_size}"
            f"{', tied embeddings' if self.tie_embeddings else ''}"
        )


# --- construction ----------------------------------------------------------------------------------------------
SIZE_FIELDS = (
    *("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
    *("head_dim", "vocab_size", "max_position_embeddings", "num_local_experts", "num_experts_per_tok"),
    *("num_experts", "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "first_k_dense_replace"),
    *("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window"),
    *("intermediate_size_mlp", "interleave_moe_layer_step", "attention_chunk_size", "decoder_sparse_step"),
    *("n_embd", "n_head", "n_layer", "n_inner", "n_positions"),
)
"""The Hugging Face config fields the readers use as integer sizes (transformers sizes tensors with them)."""


def from_hf_config(cfg: dict[str, Any], name: str = "config", source: str = "config") -> ModelSpec:
    """Build a spec from a Hugging Face config dict (config.json contents): analytically for the families in
    llmctl.families, else measured on fake tensors (needs torch and transformers)."""
    if not isinstance(cfg, dict):
        raise SpecError(f"{name}: a config must be a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt is None:
        raise SpecError(f"{name}: no 'model_type' field", hint="is this a Hugging Face config.json?")
    if not isinstance(mt, str) or not mt:
        raise SpecError(f"{name}: model_type must be a name, got {mt!r}")
    from llmctl.families import ANALYTICAL_MODEL_TYPES, read_family

    if mt not in ANALYTICAL_MODEL_TYPES:
        return from_measurement(cfg, name, source)

    f = read_family(cfg, name)
    layers: tuple[Layer, ...] = f.pop("layers")
    if not layers:
        raise SpecError(f"{name}: num_hidden_layers must be positive, got 0")
    first_moe = next((la.mlp for la in layers if la.mlp.moe), None)
    at = layers[0].attention
    return ModelSpec(
        name=name,
        model_type=mt,
        num_layers=len(layers),
        head_dim=at.head_dim,
        intermediate_size=layers[0].mlp.intermediate_size,
        qkv_bias=at.qkv_bias,
        num_experts=first_moe.num_experts if first_moe else 0,
        experts_per_token=first_moe.experts_per_token if first_moe else 0,
        hf_config=dict(cfg),
        source=source,
        layers=layers,
        **f,
    )


Measurer = Callable[[dict[str, Any]], dict[str, Any]]
_measurer: list[Measurer] = []


def set_measurer(measure: Measurer | None) -> None:
    """Install the function that measures a config outside the analytical families (the CLI and the engine install
    llmctl.measure.fake's; spec/ never imports torch itself). None removes it."""
    _measurer[:] = [measure] if measure is not None else []


def from_measurement(cfg: dict[str, Any], name: str, source: str) -> ModelSpec:
    """A model_type outside the analytical families: measured by the installed measurer (on fake tensors), or refused
    in one line when none is installed."""
    if not _measurer:
        raise SpecError(
            f"{name}: model_type {cfg['model_type']!r} is not supported",
            hint="supported: " + ", ".join(analytical_model_types()),
        )
    return spec_from_measurement(cfg, _measurer[0](cfg), name, source)


def spec_from_measurement(cfg: dict[str, Any], m: dict[str, Any], name: str, source: str) -> ModelSpec:
    """A spec whose counts and activation bytes are the measurement's (blocks carry their measured kind)."""
    vocab = int(_first(cfg, "vocab_size", default=0) or 0)
    h = int(_first(cfg, "hidden_size", "n_embd", "d_model", default=0) or 0)
    h = h or (int(m["embedding_params"]) // vocab if vocab else 0)
    if h <= 0:
        raise SpecError(f"{name}: cannot tell the hidden size of model_type {cfg['model_type']!r}")
    heads = int(_first(cfg, "num_attention_heads", "n_head", default=1) or 1)
    head_dim = int(_first(cfg, "head_dim", default=0) or 0) or max(1, h // heads)
    by_index: dict[int, str] = {}
    for k in m["layers"]:
        for i in k["indices"]:
            by_index[i] = k["kind"]
    n = len(by_index)
    placeholder = Attention(heads, heads, head_dim, head_dim)
    layers = tuple(Layer(placeholder, Mlp("swiglu", max(1, h)), measured_kind=by_index[i]) for i in range(n))
    return ModelSpec(
        name=name,
        model_type=cfg["model_type"],
        num_layers=n,
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=max(1, int(_first(cfg, "intermediate_size", "n_inner", default=4 * h) or 4 * h)),
        vocab_size=vocab,
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", "n_positions", default=4096) or 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hf_config=dict(cfg),
        source=source,
        layers=layers,
        measured=m,
    )


def _first(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(cfg.get(n), int) and not isinstance(cfg.get(n), bool):
            return cfg[n]
    return default


@lru_cache(maxsize=1)
def _preset_entries() -> tuple[dict[str, Any], ...]:
    text = resources.files("llmctl.spec").joinpath("presets/models.yaml").read_text()
    return tuple(yaml.safe_load(text))


def preset_names() -> list[str]:
    return [e["name"] for e in _preset_entries()]


def preset_entry(name: str) -> dict[str, Any]:
    """A copy of a preset's catalog entry (deep: transformers >= 5 standardises a config's rope_scaling dict in place,
    adding rope_theta to it, and the cached catalog must not keep what one caller's config did)."""
    for e in _preset_entries():
        if e["name"].lower() == name.lower() or e.get("hf_id", "").lower() == name.lower():
            return copy.deepcopy(e)
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
    """MODEL argument -> spec: a preset name, the hub id of a preset, a config.json file or folder, any other hub id
    (its config.json from the local Hugging Face cache, or downloaded), or --params."""
    if params is not None:
        if name:
            raise SpecError("give either a MODEL or --params, not both")
        return from_param_count(params)
    if not name:
        raise SpecError("no model given", hint="pass a preset name, a config.json path, a hub id, or --params 7B")
    p = Path(name)
    if p.suffix == ".json" or p.is_dir() or p.is_file():
        return from_config_path(p)
    return from_name(name)


def from_config_ref(ref: str) -> ModelSpec:
    """A plan's model.config: a config.json path (file or folder) or a hub id."""
    from llmctl.spec import hub

    p = Path(ref)
    if p.suffix != ".json" and not p.exists() and hub.looks_like_hub_id(ref):
        cfg, _ = hub.load_hub_config(ref)
        return from_hf_config(cfg, name=ref, source="hub")
    return from_config_path(p)


def from_name(name: str) -> ModelSpec:
    """A preset (by name or hub id), else a hub id's config.json."""
    from llmctl.spec import hub

    try:
        return from_preset(name)
    except UnknownNameError:
        if not hub.looks_like_hub_id(name):
            raise
    try:
        cfg, where = hub.load_hub_config(name)
    except SpecError as e:
        if hub.cached_config_path(name, None, hub.hub_cache_dir()) is not None:
            raise  # the cached config itself is bad: say so, never guess past it
        entry = preset_variant(name)
        if entry is None:
            close = suggest(name, [*preset_hub_ids(), *hub.cached_repo_ids()])
            raise SpecError(e.message, hint=f"{close} {e.hint or ''}".strip() if close else e.hint) from None
        print(
            f"llmctl: note: {name}: config.json is not cached here; planned as preset {entry['name']} "
            f"({entry['hf_id']}: the same architecture, another checkpoint of it)",
            file=sys.stderr,
            flush=True,
        )
        return from_hf_config(entry["config"], name=name, source="preset")
    return from_hf_config(cfg, name=name, source="hub")


VARIANT_WORDS = frozenset({"instruct", "base", "chat", "it", "hf", "pt", "thinking"})
"""Words of a hub id that name another checkpoint of the same architecture (Llama-3.1-8B-Instruct, Qwen3-8B-Base,
gemma-2-9b-it, Llama-2-7b-chat-hf); a 4-digit word is a release date (Mistral-Nemo-Instruct-2407,
Qwen3-235B-A22B-Instruct-2507). Version words (v0.2) are not: their configs differ."""


def _core_name(repo_id: str) -> str:
    words = repo_id.rsplit("/", 1)[-1].lower().split("-")
    return "-".join(w for w in words if w not in VARIANT_WORDS and not re.fullmatch(r"\d{4}", w))


def preset_variant(repo_id: str) -> dict[str, Any] | None:
    """The preset whose hub id is `repo_id` but for its variant words (same organisation), or None."""
    org, core = repo_id.split("/", 1)[0].lower(), _core_name(repo_id)
    for e in _preset_entries():
        hf = e.get("hf_id", "")
        if hf and hf.split("/", 1)[0].lower() == org and _core_name(hf) == core:
            return copy.deepcopy(e)
    return None


def preset_hub_ids() -> list[str]:
    return [e["hf_id"] for e in _preset_entries() if e.get("hf_id")]
