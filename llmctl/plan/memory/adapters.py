"""LoRA and QLoRA in the memory model: the frozen base, the adapters' states and what the adapters change in the
activations (torch-free).

What llmctl's engine holds with adapters (peft's `inject_adapter_in_model` on the transformers model, then FSDP2):
- the frozen base (every parameter that is not an adapter) in the compute dtype, sharded, requires_grad False; under
  QLoRA the blocks' linear weights in NF4 instead (torchao's NF4Tensor, sized by llmctl.spec.nf4);
- the adapters A (r x in) and B (out x r) of each targeted linear in the param dtype (fp32 masters under bf16-mixed),
  sharded, with gradients in the reduce dtype and optimizer states: for them only;
- FSDP2 all-gathers the frozen layer with its adapters (compute dtype) as in full training, and reduce-scatters only
  the adapters' gradients.

Activations, measured on the CPU with saved_tensors_hooks (tests/plan/test_lora_memory.py, exact to the byte for the
Llama-style blocks and GPT-2's): a frozen weight changes what autograd keeps, and the adapters add their own.
- A linear whose weight is frozen keeps no input (its input is needed only for its weight's gradient); an adapter's
  lora_A keeps the same input when peft's lora_dropout is 0 (nn.Identity: the same tensor). So an input stays saved
  only where some adapter reads it undropped; with dropout > 0 each adapter keeps its own dropped copy and mask.
- A frozen norm weight keeps no normalised output (it served the weight's gradient only); the q/k norms likewise.
- Each adapter keeps lora_A's output (b*s*r, compute dtype) for lora_B's weight gradient.
- The embedding is frozen: its output needs no gradient, so the first block's first norm keeps nothing, and neither
  the token ids for the embedding's backward, nor the LM head (frozen) its input, nor the final norm its output.
Mixture-of-experts blocks: the routed experts (3-D tensors, not adapted) are left as full training keeps them (an
over-estimate: a frozen expert keeps no input either); MLA's latent path likewise.
"""

from __future__ import annotations

import math

from llmctl.plan import flops as fl
from llmctl.plan.memory.ledger import StateLine, _largest_rank_bytes, optimizer_bytes_per_param
from llmctl.spec import nf4
from llmctl.spec import optimizer_states as ostates
from llmctl.spec.attention import Attention
from llmctl.spec.finetune import Finetune, adapted_linears, adapter_params, targets_for
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.precision import DTYPE_BYTES
from llmctl.spec.setup import TrainSetup

NF4_BYTES_PER_WEIGHT = nf4.BYTES_PER_WEIGHT_BF16
"""A large weight's NF4 bytes per value (llmctl.spec.nf4: 4-bit codes, an int8 absmax per 64, a bf16 scale per 256
absmaxes; bitsandbytes keeps that scale in fp32, 4.127 bits against 4.125). The ledger sizes each weight exactly
(`nf4_base_bytes`); the step time and the gathered layer use this."""

# Linears grouped by the tensor they read (one saved input per group, q/k/v sharing the attention norm's output).
ATTN_IN = frozenset(("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn"))
MLP_IN = frozenset(("gate_proj", "up_proj", "gate_up_proj", "c_fc"))
ATTN_OUT = frozenset(("o_proj", "attn.c_proj"))
MLP_OUT = frozenset(("down_proj", "mlp.c_proj"))


def _short(module: str) -> str:
    """`self_attn.q_proj` -> q_proj; GPT-2's two c_proj keep their parent (attn.c_proj, mlp.c_proj)."""
    parts = module.split(".")
    return ".".join(parts[-2:]) if parts[-1] == "c_proj" else parts[-1]


def _index_of(spec: ModelSpec, layer: Layer) -> int:
    return spec.layers.index(layer)


def layer_adapters(spec: ModelSpec, layer: Layer, finetune: Finetune) -> list[tuple[str, int, int]]:
    """(short module name, in, out) of the adapted linears of one block."""
    if not finetune.adapters or spec.measured is not None:
        return []
    targets = targets_for(spec, finetune)
    key = ("layer_adapters", layer, finetune)
    return fl._memo(
        spec, key, lambda: [(_short(m), i, o) for m, i, o in adapted_linears(spec, targets, _index_of(spec, layer))]
    )


def adapter_layer_params(spec: ModelSpec, finetune: Finetune) -> int:
    """Adapter parameters of the block with the most of them (what FSDP gathers, and reduces, per layer)."""
    return max(
        (finetune.rank * sum(i + o for _, i, o in layer_adapters(spec, la, finetune)) for la, _ in spec.layer_groups),
        default=0,
    )


def quantized_params(spec: ModelSpec) -> int:
    """QLoRA: the weights stored in NF4, every 2-D matmul weight inside the blocks (bitsandbytes replaces each Linear,
    and GPT-2's Conv1D; routed experts kept as 3-D tensors, the embeddings, norms, biases and LM head are not)."""
    total = 0
    for layer, n in spec.layer_groups:
        tensors = spec.layer_tensors(_index_of(spec, layer)) if spec.measured is None else []
        total += n * sum(math.prod(s) for name, s in tensors if name.endswith(".weight") and len(s) == 2)
    return total


def nf4_base_bytes(spec: ModelSpec, shard: int, compute_bytes: int) -> tuple[int, float]:
    """QLoRA: (weights stored in NF4, their bytes over all ranks) as the engine stores them over an FSDP group of
    `shard`: each block linear whose shape NF4 can split (llmctl.spec.nf4.scaler_block), at its own scale block."""
    return fl._memo(spec, ("nf4_base_bytes", shard, compute_bytes), lambda: _nf4_base_bytes(spec, shard, compute_bytes))


def _nf4_base_bytes(spec: ModelSpec, shard: int, compute_bytes: int) -> tuple[int, float]:
    count, total = 0, 0.0
    for layer, n in spec.layer_groups:
        tensors = spec.layer_tensors(_index_of(spec, layer)) if spec.measured is None else []
        for name, shape in tensors:
            if not (name.endswith(".weight") and len(shape) == 2):
                continue
            b = nf4.nf4_bytes(tuple(shape), shard, compute_bytes)
            if b is not None:
                count += n * math.prod(shape)
                total += n * b
    return count, total


def base_bytes_per_param(spec: ModelSpec, setup: TrainSetup) -> float:
    """The frozen base's bytes per model parameter: the compute dtype's, the NF4 linears' under QLoRA."""
    cb = setup.compute_bytes
    if setup.finetune.method != "qlora":
        return float(cb)
    q, q_bytes = nf4_base_bytes(spec, setup.dims.fsdp_shard, cb)
    return (q_bytes + (spec.params - q) * cb) / spec.params


def _qlora_base_name(spec: ModelSpec, setup: TrainSetup) -> str:
    """The QLoRA base's line, saying how much of the model is NF4 when it is not most of it: a MoE's experts are
    stacked parameters, not nn.Linear layers, and stay in the compute dtype (Qwen3-30B-A3B: ~1.95 bytes/param, not
    ~0.6), which the bytes per parameter alone would leave unexplained."""
    dtype = setup.precision.compute_dtype
    q, _ = nf4_base_bytes(spec, setup.dims.fsdp_shard, setup.compute_bytes)
    share = q / spec.params if spec.params else 0.0
    if share >= 0.5:
        return f"frozen base (NF4 linears, {dtype} rest, sharded)"
    rest = f"{dtype} rest: experts" if spec.moe else f"{dtype} rest"
    return f"frozen base (NF4 linears {share:.1%} of params, {rest}, sharded)"


def gathered_layer_bytes(spec: ModelSpec, setup: TrainSetup, layer_params: float) -> float:
    """Bytes of one layer as FSDP all-gathers it: the compute dtype's copy in full training; with adapters the frozen
    layer (NF4 linears under QLoRA) and its adapters in the compute dtype."""
    cb = setup.compute_bytes
    ft = setup.finetune
    if not ft.adapters:
        return layer_params * cb
    base = layer_params * cb
    if ft.method == "qlora":
        q = max(
            (
                sum(
                    math.prod(s)
                    for n, s in spec.layer_tensors(_index_of(spec, la))
                    if n.endswith(".weight") and len(s) == 2
                )
                for la, _ in spec.layer_groups
            ),
            default=0,
        )
        base -= q * (cb - NF4_BYTES_PER_WEIGHT)
    return base + adapter_layer_params(spec, ft) * cb


def dequantized_linear_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """QLoRA: the largest block linear's weight dequantized to the compute dtype while it runs (forward and backward)."""
    if setup.finetune.method != "qlora" or spec.measured is not None:
        return 0
    most = 0
    for layer, _ in spec.layer_groups:
        for name, s in spec.layer_tensors(_index_of(spec, layer)):
            if name.endswith(".weight") and len(s) == 2:
                most = max(most, math.prod(s))
    return most * setup.compute_bytes


# --- the ledger --------------------------------------------------------------------------------------------------
def _adapter_shapes(spec: ModelSpec, ft: Finetune) -> list[tuple[tuple[int, ...], int]]:
    """(shape, how many) of every A (r x in) and B (out x r) over the model."""
    out = []
    for layer, n in spec.layer_groups:
        for _, i, o in layer_adapters(spec, layer, ft):
            out += [((ft.rank, i), n), ((o, ft.rank), n)]
    return out


def adapter_optimizer_line(spec: ModelSpec, setup: TrainSetup, n: int) -> StateLine:
    """The optimizer's states for the adapters only, per adapter parameter (8-bit: exact per rank, as the full ledger)."""
    opt, dtype, ft = setup.optimizer, setup.states_dtype, setup.finetune
    name = f"optimizer states ({opt}{'' if dtype == 'fp32' else ', ' + ostates.KINDS[dtype].label}, adapters only)"
    if dtype == "8bit":
        deg = setup.dims.fsdp_shard
        rank = _largest_rank_bytes(_adapter_shapes(spec, ft), deg, setup.precision.param_bytes)
        return StateLine(name, rank * deg / max(1, n), 1, params=n, rank_bytes=rank)
    state = DTYPE_BYTES[dtype]
    if opt == "adafactor":  # factored second moment: rows + cols per matrix
        total = sum(c * (s[0] + s[1]) * state for s, c in _adapter_shapes(spec, ft))
        return StateLine(name, total / max(1, n), 1, params=n)
    return StateLine(name, optimizer_bytes_per_param(spec, opt, state), 1, params=n)


def adapter_ledger(spec: ModelSpec, setup: TrainSetup) -> list[StateLine]:
    """The model-state lines with adapters (module docstring): the frozen base per model parameter, the adapters,
    their gradients and optimizer states per adapter parameter (StateLine.params), all sharded by FSDP2."""
    p, ft = setup.precision, setup.finetune
    n = adapter_params(spec, ft)
    if ft.method == "qlora":
        base = StateLine(_qlora_base_name(spec, setup), base_bytes_per_param(spec, setup), 3)
    else:
        base = StateLine(f"frozen base ({p.compute_dtype}, sharded)", float(p.compute_bytes), 3)
    if not setup.training:
        return [base, StateLine(f"LoRA adapters ({p.compute_dtype}, r{ft.rank})", p.compute_bytes, 3, params=n)]
    return [
        base,
        StateLine(f"LoRA adapters ({p.param_dtype}, r{ft.rank}, sharded)", p.param_bytes, 3, params=n),
        StateLine(f"gradients ({p.reduce_dtype}, adapters only)", p.reduce_bytes, 2, params=n),
        adapter_optimizer_line(spec, setup, n),
    ]


# --- activations -------------------------------------------------------------------------------------------------
def _frozen_norm_output(spec: ModelSpec, n: int, ab: int) -> int:
    """What a norm no longer keeps when its weight is frozen: its normalised output (activations._norm_bytes: ab*n,
    or fp32 where the weight multiplies in fp32); a LayerNorm (GPT-2) keeps its input and statistics either way."""
    if spec.layer_norms:
        return 0
    return 4 * n if spec.features.norm in ("gemma", "fp32_weight") else ab * n


def adapter_activation_terms(
    spec: ModelSpec, layer: Layer, b: int, s: int, ab: int, attention: str, ft: Finetune, mask_bytes: int
) -> dict[str, int]:
    """What one block saves with adapters beyond (or, negative, below) full training (module docstring)."""
    if not ft.adapters or spec.measured is not None:
        return {}
    sb, h, at, m = b * s, spec.hidden_size, layer.attention, layer.mlp
    adapters = layer_adapters(spec, layer, ft)
    drop = ft.dropout > 0
    terms = {"LoRA: lora_A outputs (b*s*r each)": ab * sb * ft.rank * len(adapters)}
    if drop:
        terms["LoRA: dropped inputs and masks"] = sum(sb * i * (ab + mask_bytes) for _, i, _ in adapters)
    kept = {name for name, _, _ in adapters} if not drop else set()
    # Inputs a frozen linear no longer keeps, unless an undropped adapter reads them (the group shares one tensor).
    inputs = {ATTN_IN: ab * sb * h}
    if not m.moe:
        inputs[MLP_IN] = ab * sb * h
        inputs[MLP_OUT] = ab * sb * m.intermediate_size
    if Attention(attention).keeps_scores or spec.features.rotary_output_copy:
        # o_proj's input is a copy of the attention output (SDPA/flash keep their own output: o_proj's is that one)
        inputs[ATTN_OUT] = ab * sb * at.num_heads * at.v_head_dim
    if at.mla:
        inputs.pop(ATTN_IN)
    dropped = sum(v for group, v in inputs.items() if not group & kept)
    norms = len(layer.norms) * _frozen_norm_output(spec, sb * h, ab)
    if at.qk_norm in ("head", "proj"):
        norms += _frozen_norm_output(spec, sb * at.num_heads * at.head_dim, ab)
        norms += _frozen_norm_output(spec, sb * at.num_kv_heads * at.head_dim, ab)
    terms["LoRA: frozen linears' inputs not kept"] = -dropped
    terms["LoRA: frozen norms' outputs not kept"] = -norms
    return terms


def adapter_layer_delta(
    spec: ModelSpec, layer: Layer, b: int, s: int, ab: int, attention: str, ft: Finetune, mask_bytes: int = 1
) -> int:
    return sum(adapter_activation_terms(spec, layer, b, s, ab, attention, ft, mask_bytes).values())


def first_block_delta(spec: ModelSpec, b: int, s: int, ab: int, ft: Finetune, mask_bytes: int = 1) -> int:
    """The first block's first norm keeps nothing (its input, the frozen embedding's output, needs no gradient): its
    input (fp32 upcast, or GPT-2's LayerNorm input) and statistics; nor do the dropouts on its output keep masks
    (their input needs no gradient either; the dropped copies stay, lora_A reads them). Negative."""
    sb, h = b * s, spec.hidden_size
    norm = ab * sb * h + 2 * ab * sb if spec.layer_norms else 4 * sb * h + 4 * sb
    masks = 0
    if ft.dropout > 0:
        first = layer_adapters(spec, spec.layers[0], ft)
        masks = sum(mask_bytes * sb * i for name, i, _ in first if name in ATTN_IN)
    return -(norm + masks)


def head_delta(spec: ModelSpec, b: int, s: int, ab: int) -> int:
    """Head and embedding with a frozen base (negative): the final norm's output, the LM head's input, the token ids
    the embedding's backward would read and GPT-2's embedding-dropout mask."""
    sb, h = b * s, spec.hidden_size
    embd_mask = sb * h if spec.embd_dropout > 0 else 0
    return -(_frozen_norm_output(spec, sb * h, ab) + ab * sb * h + 8 * sb + embd_mask)


def stage_adapter_delta(
    spec: ModelSpec,
    layers: int,
    b: int,
    s: int,
    ab: int,
    attention: str,
    checkpointing: str,
    ft: Finetune,
    whole: int,
) -> int:
    """The adapters' change to what `layers` blocks keep: each block saved whole (`whole` of them, from the first)
    changes by adapter_layer_delta; under selective checkpointing only the adapters' own tensors are added (an
    over-estimate: what selective keeps of a frozen linear's is not modelled)."""
    if not ft.adapters or spec.measured is not None:
        return 0
    key = ("adapter_delta", layers, b, s, ab, attention, checkpointing, ft, whole)

    def compute() -> int:
        total = 0
        for i in range(layers):
            layer = spec.layers[i % spec.num_layers]
            t = adapter_activation_terms(spec, layer, b, s, ab, attention, ft, 1)
            if checkpointing == "selective":
                total += sum(v for v in t.values() if v > 0)
            elif i < whole:
                total += sum(t.values())
        if checkpointing == "none":
            total += first_block_delta(spec, b, s, ab, ft)
        return total

    return fl._memo(spec, key, compute)
