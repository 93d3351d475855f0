"""The model-state ledger: bytes per parameter of each state for a precision policy x optimizer, each sharded from
the ZeRO stage that shards it (Rajbhandari et al. 2020: optimizer states from stage 1, gradients from 2, parameters
from 3), and the parameters the largest pipeline stage holds after tensor-parallel division (torch-free).

Two engines keep different things:
- "fsdp2" (llmctl's engine, torch FSDP2): the sharded fp32 parameters ARE the master weights; no persistent half
  copy exists (bf16 copies exist only for the layers unsharded at the moment: the "unsharded layers" line).
  Persistent: 4 + 4 + 8 = 16 bytes/param for mixed AdamW, all sharded under FULL/HYBRID/SHARD_GRAD_OP.
- "zero" (DeepSpeed/Megatron style): a persistent half copy (sharded only at stage 3) next to the fp32 master: the
  classic 18 bytes/param of mixed-precision AdamW (4 fp32 master + 2 half weights + 4 fp32 grads + 8 Adam).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import llmctl.plan.memory.pipeline as pl
from llmctl.plan.flops import _memo
from llmctl.spec import optimizer_states as ostates
from llmctl.spec.models import ModelSpec
from llmctl.spec.precision import DTYPE_BYTES
from llmctl.spec.setup import TrainSetup


# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateLine:
    """One line of the model-state ledger."""

    name: str
    bytes_per_param: float
    sharded_from_stage: int
    """ZeRO stage from which this state is sharded over the data-parallel ranks (4: never)."""
    note: str = ""
    rank_bytes: int | None = None
    """Exact bytes on the rank that holds the most, where the state is not a flat bytes-per-parameter (8-bit Adam:
    which tensors are quantized depends on each rank's shard); `bytes_per_param` is then its average."""
    params: int | None = None
    """The parameters `bytes_per_param` counts per (None: the model's, as many as the pipeline stage holds); with LoRA
    adapters the adapters' own lines count per adapter parameter (llmctl.plan.memory.adapters)."""


def state_shard_degree(setup: TrainSetup, line: StateLine) -> int:
    """Ranks one model state is split over (1: each rank holds all of it). FSDP2 shards every state at rest
    (SHARD_GRAD_OP differs only while computing) over its group, the data-parallel shard ranks x cp (torchtitan's
    dp_shard_cp: a cp group holds one replica's states split like data-parallel ranks); ZeRO by its stage."""
    return setup.dims.fsdp_shard if setup.engine == "fsdp2" else setup.dims.shard_degree(line.sharded_from_stage)


def optimizer_bytes_per_param(spec: ModelSpec, optimizer: str, state_bytes: int) -> float:
    """Optimizer state bytes per parameter; state_bytes is 4 for fp32 states, 2 for bf16 states."""
    if optimizer == "adamw":
        return 2 * state_bytes  # exp_avg + exp_avg_sq
    if optimizer in ("lion", "sgd"):
        return state_bytes  # one momentum buffer
    if optimizer == "adamw-8bit":
        # bitsandbytes 8-bit AdamW: two uint8 states + one fp32 absmax per 256-element block per state.
        return 2 + 2 * 4 / 256
    if optimizer == "adafactor":
        # Adafactor (Shazeer & Stern 2018) without momentum (transformers' default beta1=None): a factored second
        # moment, rows + cols per matrix (per expert for 3-D MoE weights), the full vector for 1-D tensors.
        total = 0
        blocks = [(spec.block_tensors(layer), n) for layer, n in spec.layer_groups]
        for tensors, count in (
            *blocks,
            (spec.embedding_tensors(), 1),
            (spec.head_tensors(), 1),
        ):
            for _, shape in tensors:
                lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
                n = shape[0] if len(shape) == 1 else lead * (shape[-2] + shape[-1])
                total += count * n * state_bytes
        return total / spec.shape_params
    return 0.0


def optimizer_line(spec: ModelSpec, setup: TrainSetup) -> StateLine:
    """The optimizer-states line: the optimizer's states in the setup's `states_dtype` (fp32, bf16, or torchao's
    8-bit block-wise AdamW, exact per rank where the model's tensors are known)."""
    opt, dtype = setup.optimizer, setup.states_dtype
    name = f"optimizer states ({opt}{'' if dtype == 'fp32' else ', ' + ostates.KINDS[dtype].label})"
    if dtype != "8bit":
        return StateLine(name, optimizer_bytes_per_param(spec, opt, DTYPE_BYTES[dtype]), 1)
    rank = adam_8bit_rank_bytes(spec, setup)
    if rank is None:  # tensors unknown: every value quantized, one fp32 scale per block (code books left out)
        return StateLine(name, 2 + 2 * 4 / ostates.BLOCK_SIZE_8BIT, 1)
    held, _ = stage_params(spec, setup)
    return StateLine(name, rank * setup.dims.fsdp_shard / held, 1, rank_bytes=rank)


def adam_8bit_rank_bytes(spec: ModelSpec, setup: TrainSetup) -> int | None:
    """Bytes of torchao AdamW8bit's two moments on the rank that holds the most, in llmctl's engine (FSDP2): each
    tensor's local shard (dim 0 split over the shard group as torch.chunk splits it, as fully_shard does) is
    quantized or kept in the parameter's dtype by its own size (llmctl.spec.optimizer_states.adam_8bit_bytes).
    Exact at tp = 1; under tp each split tensor counts tp's share on dim 0 (the same sizes, rows approximated).
    None where the tensors are not known (a model measured on fake tensors, a raw parameter count) or under the
    zero engine (DeepSpeed partitions flat buffers)."""
    if spec.measured is not None or spec.source == "params" or setup.engine != "fsdp2":
        return None
    key = (
        "adam_8bit",
        setup.dims.fsdp_shard,
        pl.layer_ranks(setup),
        setup.pp,
        setup.pipeline_stages,
        setup.precision.param_bytes,
    )
    return _memo(spec, key, lambda: _adam_8bit_rank_bytes(spec, setup))


def _adam_8bit_rank_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    return max(adam_8bit_pipeline_rank_bytes(spec, setup, r) for r in pl.pipeline_ranks(spec, setup))


def adam_8bit_pipeline_rank_bytes(spec: ModelSpec, setup: TrainSetup, prank: pl.PipelineRank) -> int:
    """adam_8bit_rank_bytes for the GPUs of one pp rank: its blocks, its embedding or norm + head (the tied
    embedding's copy on the last stage under pp, llmctl.plan.memory.pipeline)."""
    deg, ways, fallback = setup.dims.fsdp_shard, pl.layer_ranks(setup), setup.precision.param_bytes
    shapes: list[tuple[tuple[int, ...], int]] = []  # (shape before FSDP, how many)
    for layer, n in Counter(spec.layers[i] for i in prank.blocks).items():
        tensors = spec.block_tensors(layer)
        moe = any("experts" in name for name, _ in tensors)  # a MoE block stays whole under tp (ledger above)
        shapes += [(_tp_shape(name, shape, ways, moe), n) for name, shape in tensors]
    ends = (spec.embedding_tensors() if prank.embedding else []) + (spec.head_tensors() if prank.head else [])
    if prank.head and spec.tie_embeddings and setup.pp > 1:
        ends.append(("lm_head.weight", (spec.vocab_size, spec.hidden_size)))
    shapes += [(_tp_shape(name, shape, ways, False), 1) for name, shape in ends]
    return _largest_rank_bytes(shapes, deg, fallback)


def _tp_shape(name: str, shape: tuple[int, ...], ways: int, moe: bool) -> tuple[int, ...]:
    """A tensor's shape on one of the `ways` tp ranks, its split counted on dim 0 (norms, and MoE blocks, are
    replicated)."""
    if ways == 1 or not shape or "norm" in name or (moe and name.startswith("mlp.")):
        return shape
    return (-(-shape[0] // ways), *shape[1:])


def _largest_rank_bytes(shapes: list[tuple[tuple[int, ...], int]], deg: int, fallback: int) -> int:
    """The most 8-bit Adam bytes any of `deg` ranks holds. Rank r holds min(c, d0 - r c) rows (c = ceil(d0 / deg))
    of each tensor: full below d0 // c, partial at it, none after, so the ranks that differ start at 0 or at one of
    those two places of some tensor: those are the ranks to try (a quantized shard can be smaller than one kept
    whole, so the first rank is not always the largest)."""
    starts = {0}
    for shape, _ in shapes:
        d0 = shape[0] if shape else 1
        full = d0 // -(-d0 // deg)
        starts.update(r for r in (full, full + 1) if r < deg)
    most = 0
    for r in starts:
        total = 0
        for shape, n in shapes:
            d0, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            c = -(-d0 // deg)
            total += n * ostates.adam_8bit_bytes(max(0, min(c, d0 - r * c)) * rest, fallback)
        most = max(most, total)
    return most


def full_ledger(spec: ModelSpec, setup: TrainSetup) -> list[StateLine]:
    """The model-state lines of full training (every parameter trained) under the setup's precision policy and
    optimizer, each with the ZeRO stage that shards it (with adapters: llmctl.plan.memory.states.state_ledger)."""
    p = setup.precision
    if not setup.training:
        full = p.compute_dtype == "fp32"
        return [StateLine(f"weights ({'fp32' if full else 'half'})", p.compute_bytes, 3)]
    opt_line = optimizer_line(spec, setup)
    if not p.mixed:
        return [
            StateLine(f"parameters ({p.param_dtype})", p.param_bytes, 3),
            StateLine(f"gradients ({p.reduce_dtype})", p.reduce_bytes, 2),
            opt_line,
        ]
    half = p.compute_dtype
    if setup.engine == "fsdp2":
        return [
            StateLine(f"parameters ({p.param_dtype} master, sharded)", p.param_bytes, 3),
            StateLine(f"{half} weights", 0, 3, note="FSDP2: transient only, see 'unsharded layers'"),
            StateLine(f"gradients ({p.reduce_dtype})", p.reduce_bytes, 2),
            opt_line,
        ]
    # ZeRO keeps the fp32 master copy inside the optimizer partition (stage 1) and the half weights as the model.
    return [
        StateLine(f"master weights ({p.param_dtype})", p.param_bytes, 1),
        StateLine(f"{half} weights", p.compute_bytes, 3),
        StateLine(f"gradients ({p.reduce_dtype})", p.reduce_bytes, 2),
        opt_line,
    ]


def model_bytes_per_param(spec: ModelSpec, ledger: list[StateLine]) -> float:
    """The ledger's bytes per model parameter: lines that count per adapter parameter weighed by their share."""
    return sum(
        line.bytes_per_param * (line.params if line.params is not None else spec.params) / spec.params
        for line in ledger
    )


def stage_params(spec: ModelSpec, setup: TrainSetup) -> tuple[int, int]:
    """(parameters held by the heaviest pipeline rank after TP division, blocks on it). Exact per rank under pp
    (llmctl.plan.memory.pipeline: torchtitan's split, the embedding on the first stage, norm + head on the last).
    Cached per spec."""
    key = ("stage_params", pl.layer_ranks(setup), setup.pp, setup.engine, setup.pipeline_stages, setup.pp_schedule)
    return _memo(spec, key, lambda: _stage_params(spec, setup))


def _stage_params(spec: ModelSpec, setup: TrainSetup) -> tuple[int, int]:
    if setup.pp > 1:
        ranks = [(pl.rank_params(spec, setup, r), len(r.blocks)) for r in pl.pipeline_ranks(spec, setup)]
        return max(ranks)
    ways = pl.layer_ranks(setup)
    if ways == 1:
        return spec.params, spec.num_layers

    per = {layer: pl.tp_block_params(spec, setup, layer) for layer, _ in spec.layer_groups}
    # The final norm is replicated over the tp group like the blocks' norms; the LM head is split by vocabulary.
    final_norm = 0 if spec.measured is not None else sum(math.prod(s) for n, s in spec.head_tensors() if "norm" in n)
    ends = [spec.embedding_params / ways, (spec.head_params - final_norm) / ways + final_norm]
    return int(round(sum(per[la] for la in spec.layers) + sum(ends))), spec.num_layers
