"""The fewest GPUs of a kind that fit a model, over the levers the planner searches (torch-free).

`llmctl.plan.memory.min_gpus` answers for one layout: the setup's tp, cp and pp, sharding over more GPUs until the
states fit. A model whose unsharded pieces outgrow a GPU (Llama-3.1-405B's layers in flight and activations on a 24
GB card) fits on no count of GPUs at tp 1, yet fits with tensor or pipeline parallelism. So the fewest-GPU answer of
`estimate-memory`, of `plan` when nothing fits, and of `plan --compare` asks every layout the planner could pick
(llmctl.plan.space: tp over the GPUs of a node that divide the model's heads, cp where the model's attention runs a
ring and the sequence splits, pp where the engine runs pipelines and the layers split), each with the least memory
of its levers (micro-batch 1, full checkpointing, the loss in chunks where tp is 1), and keeps the smallest count;
between equal counts the one with the least model parallelism (fewer collectives on the critical path). CPU offload
is the caller's second try (`offload=True`), after a count without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmctl.errors import InputError
from llmctl.families.context_parallel import cp_problem
from llmctl.families.tensor_parallel import valid_tp
from llmctl.plan.memory.estimate import min_gpus
from llmctl.spec.attention import Attention
from llmctl.spec.parallel import sequence_split_problem
from llmctl.spec.pipeline import max_stages
from llmctl.spec.rules import engine_problem, model_problem
from llmctl.units import GIB

if TYPE_CHECKING:
    from llmctl.spec.models import ModelSpec
    from llmctl.spec.setup import TrainSetup

# Chunked loss: one chunk's logits are about 2^26 elements (512 MiB for the fp32 log-softmax and its gradient in
# backward): 512 tokens for Llama 3's 128k vocabulary, 2048 for Llama 2's 32k; never below 256 tokens (smaller
# GEMMs lose efficiency) nor above 8192.
LOSS_CHUNK_ELEMENTS = 2**26


def auto_loss_chunk(spec: ModelSpec) -> int:
    """Tokens per loss chunk when the planner chunks the loss (LOSS_CHUNK_ELEMENTS)."""
    c = 1 << max(0, (LOSS_CHUNK_ELEMENTS // max(1, spec.vocab_size)).bit_length() - 1)
    return min(8192, max(256, c))


MAX_CP = 64
"""The largest ring searched: past 64 ranks a sequence's share (a 1M-token sequence: 16k tokens a rank) no longer
buys memory that pipeline or tensor parallelism would not."""


@dataclass(frozen=True)
class Fewest:
    """The fewest GPUs that fit and the setup that fits on them."""

    gpus: int
    nodes: int
    setup: TrainSetup
    device_bytes: int

    @property
    def layout(self) -> str:
        """'tp 8 x pp 4', or 'no model parallelism'."""
        s = self.setup
        parts = [f"{k} {v}" for k, v in (("tp", s.tp), ("cp", s.cp), ("pp", s.pp)) if v > 1]
        return " x ".join(parts) or "no model parallelism"

    def shape(self, gpus_per_node: int) -> str:
        """'64 nodes x 8' or '4 GPUs on one node'."""
        if self.nodes > 1:
            return f"{self.nodes} nodes x {gpus_per_node}"
        return f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} on one node"

    def words(self) -> str:
        """The setup in a line: 'tp 8, full_shard, full checkpointing, micro-batch 1 (21.7 GiB per GPU)'."""
        s = self.setup
        chunk = f", the loss in chunks of {s.loss_chunk_tokens:,}" if s.loss_chunk_tokens else ""
        offload = ", CPU offload" if s.levers.offload else ""
        return (
            f"{self.layout}, full_shard, {s.checkpointing} checkpointing{chunk}{offload}, micro-batch "
            f"{s.micro_batch_size} ({self.device_bytes / GIB:.1f} GiB per GPU)"
        )

    def as_dict(self) -> dict[str, object]:
        s = self.setup
        return {
            "gpus": self.gpus,
            "nodes": self.nodes,
            "tp": s.tp,
            "cp": s.cp,
            "pp": s.pp,
            "checkpointing": s.checkpointing,
            "loss_chunk_tokens": s.loss_chunk_tokens,
            "offload": s.levers.offload,
            "micro_batch_size": s.micro_batch_size,
            "per_gpu_total_bytes": self.device_bytes,
            "line": self.words(),
        }


def _cps(spec: ModelSpec, seq_len: int) -> list[int]:
    """1, and the rings of powers of two (up to MAX_CP) whose 2cp chunks split the sequence, where the model's
    attention runs one (a flash-attn request runs its ring on SDPA, as the planner's cp families do)."""
    if cp_problem(spec, seq_len) is not None:
        return [1]
    out, cp = [1], 2
    while cp <= MAX_CP and sequence_split_problem(seq_len, 1, cp) is None:
        out.append(cp)
        cp *= 2
    return out


def _pps(spec: ModelSpec, base: TrainSetup) -> list[int]:
    """1, and the powers of two the layers split into where the engine runs this setup's pipelines."""
    try:
        probe = _with(base, nodes=1, gpus_per_node=2, tp=1, cp=1, pp=2, grad_accum_steps=4)
    except InputError:
        return [1]
    if engine_problem(probe) is not None or model_problem(probe, spec, only=("pp split",)) is not None:
        return [1]
    out, pp, most = [1], 2, max_stages(spec.num_layers)
    while pp <= most:
        out.append(pp)
        pp *= 2
    return out


def fewest(
    spec: ModelSpec,
    base: TrainSetup,
    capacity_bytes: int,
    host_memory_bytes: int | None = None,
    max_nodes: int = 4096,
) -> Fewest | None:
    """The fewest GPUs (of `base.gpus_per_node` a node, `capacity_bytes` each) on which some layout of `base` fits
    (module doc), or None. `base` carries the other levers (checkpointing, loss chunk, attention, offload, precision,
    micro-batch) as the caller sets them."""
    g = base.gpus_per_node
    layouts = sorted(
        ((tp, cp, pp) for tp in valid_tp(spec, g) for cp in _cps(spec, base.seq_len) for pp in _pps(spec, base)),
        key=lambda x: (x[0] * x[1] * x[2], x[2], x[1]),
    )
    best: Fewest | None = None
    for tp, cp, pp in layouts:
        unit = tp * cp * pp
        if best is not None and unit > best.gpus:
            break  # sorted by unit: a replica alone is more GPUs than the best count
        if tp * cp > g and (tp * cp) % g:
            continue
        choice = {"tp": tp, "cp": cp, "pp": pp, "loss_chunk_tokens": base.loss_chunk_tokens if tp == 1 else 0}
        choice["nodes"] = -(-unit // g)  # a world that holds one replica (min_gpus then tries more)
        if cp > 1:
            choice["attention"] = Attention.SDPA.value  # ring attention runs on SDPA's kernels
        if pp > 1:
            choice["grad_accum_steps"] = max(base.grad_accum_steps, 2 * pp)  # 1F1B's micro-batches in flight
        try:
            setup = _with(base, **choice)
        except InputError:
            continue
        if model_problem(setup, spec) is not None or engine_problem(setup) is not None:
            continue
        limit = max_nodes if best is None else max(1, best.nodes)
        try:
            m = min_gpus(
                spec, setup, capacity_bytes, "full_shard", max_nodes=limit, host_memory_bytes=host_memory_bytes
            )
        except InputError:
            continue
        if m.gpus is None or m.nodes is None or m.device_bytes is None:
            continue
        if best is None or m.gpus < best.gpus:
            best = Fewest(m.gpus, m.nodes, _with(setup, nodes=m.nodes, gpus_per_node=m.gpus // m.nodes), m.device_bytes)
    return best


def _with(setup: TrainSetup, **choice: object) -> TrainSetup:
    from llmctl.spec.decisions import with_values

    return with_values(setup, **choice)
