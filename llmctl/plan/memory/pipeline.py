"""Pipeline parallelism's memory per pp rank (torch-free): which stages a rank holds (llmctl.spec.pipeline's torchtitan
split and placement), how many micro-batches of each of them it keeps at its peak, its exact parameters after the
tensor-parallel split, and the buffers torch.distributed.pipelining allocates for the stage boundaries.

What torch.distributed.pipelining keeps (torch/distributed/pipelining/stage.py, PipelineStage, torch 2.13):
- a receive buffer per micro-batch of a schedule run for the boundary activation each stage but the first receives
  (`_setup_forward_recv_info`: one `_make_tensor_from_meta` per chunk id), and one per micro-batch for the gradient each
  stage but the last receives (`_setup_backward_recv_info`); made once, kept for the whole run;
- the received activation's gradient (`.grad` of each forward receive buffer, a leaf: `stage_backward` accumulates into
  it) until the next step's `clear_runtime_states`;
- each forward's output in `fwd_cache` until that micro-batch's backward (`stage_backward` starts from it): the stage's
  last block output, which nothing inside the stage saves;
- under FSDP2, `backward_maybe_with_nosync` turns gradient sync and resharding after backward off for every micro-batch
  and `perform_reduce_grad` reduce-scatters once after the schedule's last backward: the rank's parameters stay
  unsharded (torchtitan also keeps them unsharded after forward under pp: reshard_after_forward=False) and their
  gradients accumulate unsharded, in the reduce dtype (FSDPParam.to_accumulated_grad_if_needed), until then.

Tied embeddings: torchtitan's split cannot tie across stages; a stage split counts the LM head as its own copy of the
embedding matrix on the last stage (Megatron-LM's shared embedding: both copies trained, their gradients all-reduced
between the first and the last stage), so the last stage holds V x h more than the untied count of the spec says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmctl.families.tensor_parallel import replicated as tp_replicated
from llmctl.plan.flops import _memo
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.pipeline import Schedule, StagePart, in_flight, split_layers, stages_of_rank, zbv_held
from llmctl.spec.setup import TrainSetup


@dataclass(frozen=True)
class HeldStage:
    """One stage a pp rank runs and the micro-batches of its activations the rank holds at its peak."""

    part: StagePart
    micro_batches: int

    @property
    def receives(self) -> bool:
        """The stage's input comes from the previous stage (not the token ids)."""
        return not self.part.embedding

    @property
    def sends(self) -> bool:
        """The stage's output goes to the next stage (not to the loss)."""
        return not self.part.head


@dataclass(frozen=True)
class PipelineRank:
    """What one pp rank holds of the model and of the schedule's activations."""

    rank: int
    held: tuple[HeldStage, ...]
    in_flight: int
    """Stage-micro-batches of activations at the peak (llmctl.spec.pipeline.in_flight)."""

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(h.part.index for h in self.held)

    @property
    def blocks(self) -> tuple[int, ...]:
        """The decoder blocks of the rank's stages, in stage order."""
        return tuple(i for h in self.held for i in h.part.blocks)

    @property
    def embedding(self) -> bool:
        return any(h.part.embedding for h in self.held)

    @property
    def head(self) -> bool:
        return any(h.part.head for h in self.held)

    def label(self) -> str:
        """The rank's stages as a table shows them: `0`, `0, 8`."""
        return ", ".join(map(str, self.stages))


def pipeline_ranks(spec: ModelSpec, setup: TrainSetup) -> tuple[PipelineRank, ...]:
    """Every pp rank of the setup: its stages (torchtitan's split of spec.num_layers into setup.pipeline_stages, placed
    by the schedule) and the micro-batches of each it holds at its peak. One rank holding the whole model at pp 1."""
    sched, pp, m, v = setup.pp_schedule, setup.pp, setup.pipeline_microbatches, setup.virtual_stages
    parts = split_layers(spec.num_layers, setup.pipeline_stages if pp > 1 else 1)
    out = []
    for r in range(pp):
        own = stages_of_rank(sched, r, pp, v) if pp > 1 else (0,)
        k = in_flight(sched, r, pp, m, v) if pp > 1 else 1
        units = held_micro_batches(sched, pp, m, len(own), k, r)
        out.append(PipelineRank(r, tuple(HeldStage(parts[i], n) for i, n in zip(own, units)), k))
    return tuple(out)


def held_micro_batches(
    sched: Schedule, pp: int, microbatches: int, local_stages: int, units: int, rank: int = 0
) -> tuple[int, ...]:
    """How a rank's `units` in-flight stage-micro-batches fall on its `local_stages` stages at the peak: the forwards
    its warm-up runs before the first backward. Interleaved 1F1B runs `microbatches_per_round` forwards of one local
    stage before the next (torch's ScheduleInterleaved1F1B: rounds = max(1, m // pp), forward_stage_index). ZB-V
    as llmctl.spec.pipeline.zbv_held counts them (2 pp - r of the rank's first stage and r of its second, r = `rank`,
    when m >= 2 pp - 1)."""
    if local_stages == 1:
        return (units,)
    if sched is Schedule.ZBV:
        return zbv_held(rank, pp, microbatches)
    per_round = microbatches // max(1, microbatches // pp)
    counts = [0] * local_stages
    for u in range(units):
        counts[(u // per_round) % local_stages] += 1
    return tuple(counts)


def rank_params(spec: ModelSpec, setup: TrainSetup, prank: PipelineRank) -> int:
    """Parameters one GPU of pp rank `prank` holds after the tensor-parallel split (before FSDP): its blocks, the
    embedding on the first stage, the final norm and the LM head on the last (the tied embedding's copy there: module
    docstring). Norms are replicated over the tp group; in llmctl's engine a mixture-of-experts block is whole."""
    key = ("rank_params", layer_ranks(setup), setup.engine, setup.pipeline_stages, prank.stages)
    return _memo(spec, key, lambda: _rank_params(spec, setup, prank))


def _rank_params(spec: ModelSpec, setup: TrainSetup, prank: PipelineRank) -> int:
    per = {layer: tp_block_params(spec, setup, layer) for layer, _ in spec.layer_groups}
    total = sum(per[spec.layers[i]] for i in prank.blocks)
    if prank.embedding:
        total += spec.embedding_params / layer_ranks(setup)
    if prank.head:
        final_norm = (
            0 if spec.measured is not None else sum(math.prod(s) for n, s in spec.head_tensors() if "norm" in n)
        )
        tied_copy = spec.vocab_size * spec.hidden_size if spec.tie_embeddings and setup.pp > 1 else 0
        total += (spec.head_params - final_norm + tied_copy) / layer_ranks(setup) + final_norm
    return int(round(total))


def tp_block_params(spec: ModelSpec, setup: TrainSetup, layer: Layer) -> float:
    """One block's parameters on one tp rank."""
    ranks = layer_ranks(setup)
    if ranks == 1:
        return spec.params_of(layer)
    if spec.measured is not None:
        return spec.params_of(layer) / ranks
    tensors = layer.tensors(spec.hidden_size)
    # Replicated over the tp group: the norms (and MLA's latent projections), and in llmctl's engine a mixture-of-experts block whole
    # (llmctl.families.tensor_parallel: experts are not split until expert parallelism; Megatron's expert
    # tensor parallelism, the zero ledger, splits them).
    moe = setup.engine == "fsdp2" and any("experts" in n for n, _ in tensors)
    whole = sum(math.prod(s) for n, s in tensors if tp_replicated(n) or (moe and n.startswith("mlp.")))
    return (spec.params_of(layer) - whole) / ranks + whole


def layer_ranks(setup: TrainSetup) -> int:
    """Ranks one layer is split over (tensor parallelism)."""
    return setup.dims.rank_shard(setup.seq_len).tensor_ranks


def boundary_bytes(setup: TrainSetup, hidden_size: int) -> int:
    """One micro-batch's activation at a stage boundary (what a stage sends forward and receives the gradient of):
    micro-batch x this rank's tokens x hidden in the compute dtype; the tokens are the cp rank's, split again over tp
    by sequence parallelism (the residual stream between blocks is sequence-sharded)."""
    shard = setup.dims.rank_shard(setup.seq_len)
    return setup.compute_bytes * setup.micro_batch_size * shard.columns(shard.tokens) * hidden_size
