"""What a model family knows, as one `Family` entry per Hugging Face `model_type` (torch-free).

A family module (llama.py, qwen.py, gemma.py, ...) declares, for each model_type it covers: the config reader (the
headline sizes and one `Layer` per block, from the config fields its transformers modeling file reads, with the
defaults of its configuration class where a config.json may omit a field: transformers 5.x,
src/transformers/models/<type>/configuration_<type>.py), the `Features` the memory and FLOP models read instead of
the model_type, where its decoder layers sit in the transformers model, a slot for its tensor-parallel plan, and the
tiny config the tests build it from. A new family is one module and its line in llmctl/families/__init__.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llmctl.errors import SpecError
from llmctl.spec.layers import MAX_LAYERS

Config = dict[str, Any]

NORMS = ("hf_rmsnorm", "fp32_weight", "gemma", "layernorm")
BLOCKS = ("gated", "gpt2")


@dataclass(frozen=True)
class Features:
    """What the memory, FLOP and spec code read about a family's blocks beyond their shapes (llmctl.spec.layers).

    Each is a fact of the transformers modeling code, measured (tests/plan/test_families_measured.py re-measures the
    bytes every family's blocks save for backward)."""

    block: str = "gated"
    """gated: a pre-norm block with rotary attention and a gated MLP or MoE (Llama-like); gpt2: LayerNorms, one
    fused Conv1D for q/k/v, a GELU MLP, learned positions."""
    norm: str = "hf_rmsnorm"
    """What one norm keeps for backward. hf_rmsnorm: LlamaRMSNorm's fp32 upcast input, fp32 rsqrt and the output in
    the compute dtype; fp32_weight: the weight multiplied in fp32 (OLMo 2, gpt-oss: `(w * x).to(dtype)`), so the
    normalised output stays fp32; gemma: `x * (1 + w)` in fp32, plus the (1 + w) vector; layernorm: GPT-2's."""
    learned_positions: bool = False
    """One learned embedding per position (GPT-2's wpe): a sequence longer than max_position_embeddings indexes past
    the table."""
    conv1d: bool = False
    """The block's projections are transformers' Conv1D, which stores weights as (in, out) (GPT-2): peft adapts them
    with fan_in_fan_out, and a weight's rows are its inputs."""
    rotary: bool = True
    """Rotary position embeddings (rotating pairs of dimensions: head_dim must be even)."""
    rotary_tables: int = 1
    """Rotary cos/sin tables built per forward (Gemma 3: a local and a global one)."""
    rotary_complex: bool = False
    """Rotary as one complex64 freqs_cis table (Llama 4), and one attention mask per layer type present (chunked,
    full), where others build cos/sin tables in the compute dtype and one mask."""
    rotary_output_copy: bool = False
    """Phi-3 rotates with torch.cat, which leaves q laid out as (b, a, s, d): a fused kernel writes its output in
    q's layout and transformers' transpose(1, 2).contiguous() copies it for o_proj."""
    heads_split_hidden: bool = False
    """The attention splits hidden_size into num_heads equal heads (no head_dim field): hidden % heads == 0."""
    dense_moe: bool = False
    """The MoE runs every token through every expert, scaled by its router score (Llama4TextMoe), not only its
    top-k."""
    router_fp32: bool = False
    """The router runs in fp32 and keeps an fp32 copy of its input (DeepSeek-V3)."""
    eager_softmax_fp32: bool = True
    """Eager attention upcasts the scores to fp32 for the softmax (Llama 4 text does not)."""
    flash_attention: bool = True
    """transformers builds it with a flash-attention path (Llama4PreTrainedModel._supports_flash_attn = False)."""

    def __post_init__(self) -> None:
        if self.block not in BLOCKS or self.norm not in NORMS:
            raise ValueError(f"unknown block {self.block!r} or norm {self.norm!r}")


@dataclass(frozen=True)
class Family:
    """One model_type llmctl models analytically, with its hooks in one place, as torchtitan's `TrainSpec` carries a
    model's (model_args, parallelize_fn, pipelining_fn, state_dict_adapter, ...): the config reader (`read`), the
    block `features`, where the decoder layers sit, the tensor-parallel plan, the LoRA targets, and the slot pipeline
    parallelism fills (`pipeline_split`). Expert parallelism needs no slot: the engine finds the routed experts by
    transformers' experts-implementation flags (llmctl.engine.experts.is_experts), and a family whose MoE runs
    every token through every expert (`Features.dense_moe`) cannot split them. A new dimension that depends on the architecture is
    one slot here and one value per family module, not a branch on the model_type."""

    model_type: str
    family: str
    """The family module's name (llama, qwen, gemma, ...)."""
    read: Callable[[Config], dict[str, Any]]
    """config.json contents -> ModelSpec fields (headline sizes and `layers`)."""
    features: Features
    tiny: Config
    """A tiny config (2-4 blocks, hidden 64, vocabulary 300, 4 experts top-2) that keeps what makes the type differ
    from Llama: the tests build, measure and train it."""
    decoder_path: str = "model.layers"
    """Where the decoder layers sit in transformers' causal LM (dotted attributes)."""
    tp_plan: Mapping[str, str] | None = None
    """Tensor-parallel plan: a path inside one decoder layer -> a style (llmctl.families.tensor_parallel); None: the
    family cannot be split (see `tp_unsupported`)."""
    tp_unsupported: str = ""
    """Why there is no tensor-parallel plan (the refusal's words)."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """The linears LoRA adapts by default (peft target_modules: module names, matched as the last part of a dotted
    name): the attention and MLP projections (llmctl.spec.finetune); routed experts are 3-D tensors, not linears."""
    pipeline_split: Callable[[int, int], tuple[int, ...]] | None = None
    """Pipeline parallelism's split (torchtitan's `pipelining_fn` and its pipeline_parallel_split_points): (decoder
    layers, stages) -> the index of the first decoder layer of every stage after the first; the embedding stays on
    the first stage and the final norm and LM head (`tensor_parallel.ROOT`) on the last. None: not declared yet (the
    pipeline-parallelism issue fills it; an even split by layers is the default it starts from)."""
    pipeline_unsupported: str = ""
    """Why the engine's pipeline stages (llmctl.engine.pipeline: a later stage runs the base model's forward on the
    previous stage's hidden states as `inputs_embeds`) cannot run this family (the refusal's words); "" where they
    can."""
    notes: str = field(default="", compare=False)


# --- config reading helpers shared by the family modules -----------------------------------------------------------
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


def layer_count(cfg: Config, *names: str) -> int:
    """num_hidden_layers, refused past MAX_LAYERS before anything is built per layer."""
    n = integer(cfg, *names)
    if n > MAX_LAYERS:
        raise SpecError(f"{n:,} layers, more than {MAX_LAYERS:,}")
    return n


def flag(cfg: Config, name: str, default: bool = False) -> bool:
    return bool(get(cfg, name, default=default))


def rate(cfg: Config, *names: str) -> float:
    v = get(cfg, *names, default=0.0)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def layer_types(cfg: Config, n: int, default: Callable[[int], str]) -> list[str]:
    """Per-layer attention types ("full_attention", "sliding_attention", "chunked_attention"): the config's
    `layer_types` when it lists one per layer, else the family's rule."""
    lt = cfg.get("layer_types")
    if isinstance(lt, list) and len(lt) == n and all(isinstance(x, str) for x in lt):
        return list(lt)
    return [default(i) for i in range(n)]


def windows(cfg: Config, n: int, rule: Callable[[int], str]) -> list[int]:
    """Each layer's sliding window (0: full attention)."""
    w = integer(cfg, "sliding_window", default=0)
    return [w if t == "sliding_attention" else 0 for t in layer_types(cfg, n, rule)]


def headline(cfg: Config, h: int, heads: int, default_tie: bool, default_pos: int) -> dict[str, Any]:
    return {
        "hidden_size": h,
        "num_heads": heads,
        "num_kv_heads": integer(cfg, "num_key_value_heads", default=heads),
        "vocab_size": integer(cfg, "vocab_size"),
        "max_position_embeddings": integer(cfg, "max_position_embeddings", default=default_pos),
        "tie_embeddings": flag(cfg, "tie_word_embeddings", default_tie),
        "attention_dropout": rate(cfg, "attention_dropout"),
        "resid_dropout": rate(cfg, "resid_pdrop"),
        "embd_dropout": rate(cfg, "embd_pdrop"),
    }
