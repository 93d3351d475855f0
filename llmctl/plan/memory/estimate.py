"""The estimate: per-GPU bytes of one training step as the largest of four phases (end of forward, the loss's backward,
the layers' backward, optimizer step), not a blind sum; the largest micro-batch that fits; the fewest GPUs that fit
(torch-free).

The backward has two moments that do not overlap: the loss's backward (its fp32 buffers of b*s*V, next to every saved
activation, before any layer's backward) and the layers' backward (a recomputed block, one layer's unsharded
gradients for the reduce-scatter, ring or float8 buffers; the loss's buffers freed). llmctl's engine frees the
gradients after each optimizer step (zero_grad(set_to_none=True)), so with one micro-batch per step no gradient lives
in the forward or the loss's backward; with accumulation the earlier micro-batches' do. Measured on an H100
(docs/measurements/h100-gpu-tier.json, the GPU tier's five Llama-3.2-1B setups): the sum of both moments as one phase,
and gradients in every phase, over-predicted the peak by 6-14%.

What it predicts is the peak of PyTorch's *allocated* bytes (torch.cuda.max_memory_allocated) per GPU. On top of it,
the caching allocator's fragmentation headroom gives *reserved* bytes, and the CUDA context (+ NCCL buffers), which
lives outside the allocator, gives what nvidia-smi shows. A setup fits when that last figure is within the device's
memory.

CPU offload (FSDP2's CPUOffloadPolicy, `TrainSetup.levers.offload`; torch/distributed/fsdp/_fully_shard/
_fsdp_param.py and _fsdp_collectives.py): each rank's sharded parameters (the fp32 masters under mixed precision)
live on the host, pinned; each reduced gradient shard is copied there after its reduce-scatter, so the optimizer
keeps its states and steps there too. The ledger's lines are the same bytes, on the host (`host_components`, per
GPU; a node holds its GPUs' worth). The GPU keeps the activations and FSDP's unsharded layers as without offload,
and instead of the states:
- the layer being copied in: its fp32 shard, copied host-to-device on the all-gather's copy-in stream, and its cast
  to the compute dtype (the all-gather's input), both freed once the all-gather has its input. One layer at a time:
  the copy-in stream copies one layer after the other and reuses the blocks of the last in stream order, so the
  prefetched next layer's copy takes the place of the current one's.
- the reduce-scatter's output, one layer's gradient shard in the reduce dtype, until its copy to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import llmctl.plan.memory.adapters as lora
import llmctl.plan.memory.experts as ex
import llmctl.plan.memory.pipeline as pl
from llmctl.errors import InputError, RuleError
from llmctl.plan import float8 as f8
from llmctl.plan.memory.activations import (
    head_activation_bytes,
    input_ids_bytes,
    layer_activation_bytes,
    loss_chunk_backward_bytes,
    loss_chunk_forward_bytes,
    recompute_buffer_bytes,
    shared_activation_bytes,
    stage_activation_bytes,
    stage_block_mode,
    stage_blocks_saved_bytes,
)
from llmctl.plan.memory.ledger import StateLine, adam_8bit_pipeline_rank_bytes, stage_params, state_shard_degree
from llmctl.plan.memory.ring import ring_buffers
from llmctl.plan.memory.states import state_ledger
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.finetune import adapter_params
from llmctl.spec.hardware import GPUSpec
from llmctl.spec.models import ModelSpec
from llmctl.spec.parallel import canonical_strategy
from llmctl.spec.setup import TrainSetup
from llmctl.units import GIB


# --- the estimate ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    phases: tuple[str, ...]
    """Phases in which this memory is live: forward, backward, optimizer."""
    bytes_per_param: float | None = None
    note: str = ""


@dataclass(frozen=True)
class StageMemory:
    """One pp rank's memory under pipeline parallelism, by kind, each at the rank's own peak phase."""

    rank: int
    stages: tuple[int, ...]
    blocks: int
    params: int
    """Parameters one GPU of the rank holds after the tensor-parallel split (before FSDP)."""
    params_bytes: int
    """Parameter copies: the sharded masters and the unsharded compute-dtype copies."""
    grads_bytes: int
    states_bytes: int
    """Optimizer states."""
    activations_bytes: int
    """Everything else live at the peak: saved activations, the pipeline's buffers, the loss's, transients."""
    in_flight: int
    peak_phase: str
    device_bytes: int


@dataclass(frozen=True)
class MemoryEstimate:
    spec: ModelSpec
    setup: TrainSetup
    components: list[Component]
    phase_bytes: dict[str, int]
    ledger: list[StateLine] = field(default_factory=list)
    host_components: list[Component] = field(default_factory=list)
    """Under CPU offload, what this GPU's rank keeps in host memory (the ledger's lines); empty otherwise."""
    pipeline_rank: int | None = None
    """Under pipeline parallelism, the pp rank this estimate is (the heaviest)."""
    rank_estimates: tuple[MemoryEstimate, ...] = field(default=(), repr=False, compare=False)
    """Under pipeline parallelism, every pp rank's own estimate, in rank order; empty at pp 1."""

    @cached_property
    def stages(self) -> tuple[StageMemory, ...]:
        """Under pipeline parallelism, every pp rank's memory by kind (this estimate is the heaviest one's); empty at
        pp 1. Built when asked (estimate-memory's table): the planner sizes thousands of pipelines and reads none."""
        if not self.rank_estimates:
            return ()
        ranks = pl.pipeline_ranks(self.spec, self.setup)
        return tuple(_stage_memory(self.spec, self.setup, e, r) for e, r in zip(self.rank_estimates, ranks))

    @property
    def host_bytes(self) -> int:
        """Host memory this GPU's rank holds for CPU offload (0 without it)."""
        return sum(c.bytes for c in self.host_components)

    @property
    def host_node_bytes(self) -> int:
        """Host memory a node holds for CPU offload: its GPUs' worth."""
        return self.host_bytes * self.setup.gpus_per_node

    @cached_property
    def peak_phase(self) -> str:
        # cached (the estimate is frozen): device_bytes asks it twice, and the planner asks device_bytes ~10^5 times
        return max(self.phase_bytes, key=lambda k: self.phase_bytes[k])

    @cached_property
    def peak_allocated_bytes(self) -> int:
        return self.phase_bytes[self.peak_phase]

    @property
    def headroom_bytes(self) -> int:
        return int(self.peak_allocated_bytes * self.setup.headroom_fraction)

    @property
    def peak_reserved_bytes(self) -> int:
        return self.peak_allocated_bytes + self.headroom_bytes

    @property
    def device_bytes(self) -> int:
        """What the device must hold: reserved + CUDA context (compare with the GPU's memory)."""
        return self.peak_reserved_bytes + self.setup.cuda_context_bytes

    @property
    def model_state_bytes(self) -> int:
        return sum(c.bytes for c in self.components if c.bytes_per_param is not None)

    def per_component(self) -> dict[str, int]:
        """Bytes per component live at the peak phase, plus headroom and context: sums to device_bytes."""
        out = {c.name: c.bytes for c in self.components if self.peak_phase in c.phases}
        out["allocator headroom"] = self.headroom_bytes
        out["CUDA context + NCCL"] = self.setup.cuda_context_bytes
        return out


def estimate(spec: ModelSpec, setup: TrainSetup) -> MemoryEstimate:
    """Per-GPU memory of one training step (see module docstring for what is predicted): the model states, FSDP's
    gathered layers, the activations and the loss's buffers, then the buffers of one layer at a time. Under pipeline
    parallelism the heaviest pp rank's, with every rank's in `stages`."""
    _check_estimable(setup)
    if setup.pp > 1:
        return _pipeline_estimate(spec, setup)
    held_params, stage_layers = stage_params(spec, setup)
    ledger = state_ledger(spec, setup)
    experts = ex.held_expert_params(spec, setup) if setup.ep > 1 else 0.0
    comps, host = _state_components(setup, ledger, held_params, experts)
    layer_params = setup.dims.rank_shard(setup.seq_len).params(spec.params_per_layer)
    comps += _fsdp_components(spec, setup, stage_layers, layer_params)
    if setup.levers.offload:
        comps += offload_components(setup, layer_params)
    if setup.training:
        comps += _saved_activation_components(spec, setup, stage_layers)
        comps += _loss_components(spec, setup)
        if not setup.fused_optimizer:
            (host if setup.levers.offload else comps).append(_foreach_temporaries(comps + host))
    else:
        comps += _forward_only_components(spec, setup)
    comps += _one_layer_transients(spec, setup)
    if setup.training:
        comps = _in_loss_backward_all(comps, setup)
    phases = _phase_bytes(comps)
    if not setup.training:
        phases = {"forward": phases["forward"]}
    return MemoryEstimate(
        spec=spec, setup=setup, components=comps, phase_bytes=phases, ledger=ledger, host_components=host
    )


def _phase_bytes(comps: list[Component]) -> dict[str, int]:
    """Bytes live in each phase: the components' sum, each phase's in the components' order (one pass: the planner
    sums ~30 components for each of ~10^5 estimates)."""
    phases = dict.fromkeys(PHASES, 0)
    for c in comps:
        for ph in PHASES:
            if ph in c.phases:
                phases[ph] += c.bytes
    return phases


def _check_estimable(setup: TrainSetup) -> None:
    """The setups the memory model cannot size: an unresolved kernel, CPU offload outside FSDP2."""
    if not setup.attention.fixed:
        raise InputError("the memory model needs the attention kernel the run uses, not auto (TrainSetup.kernel)")
    if setup.levers.offload and setup.engine != "fsdp2":
        raise InputError(
            f"CPU offload is FSDP2's (CPUOffloadPolicy), not the {setup.engine} engine's", hint="drop --engine zero"
        )


def _state_components(
    setup: TrainSetup, ledger: list[StateLine], held_params: int, experts: float = 0.0
) -> tuple[list[Component], list[Component]]:
    """The ledger's lines on this rank, each split over its shard degree: (on the GPU, on the host). Under CPU offload
    they all live on the host. At ep > 1 the `experts` (routed-expert parameters among `held_params`) are split as
    expert parallelism splits them (llmctl.plan.memory.experts.expert_fraction)."""
    comps: list[Component] = []
    host: list[Component] = []
    for line in ledger:
        deg = state_shard_degree(setup, line)
        exact = line.rank_bytes
        count = line.params if line.params is not None else held_params  # adapters' lines: per adapter parameter
        if exact is not None:
            on_rank = exact
        elif experts:
            dense, routed = (count - experts) / deg, experts * ex.expert_fraction(setup, deg)
            on_rank = math.ceil((dense + routed) * line.bytes_per_param)
        else:
            on_rank = math.ceil(count * line.bytes_per_param / deg)
        (host if setup.levers.offload else comps).append(
            Component(
                line.name,
                int(on_rank),
                ("forward", "backward", "optimizer"),
                bytes_per_param=line.bytes_per_param / deg,
                note=line.note,
            )
        )
    return comps, host


def _fsdp_components(spec: ModelSpec, setup: TrainSetup, stage_layers: int, layer_params: float) -> list[Component]:
    """What FSDP keeps unsharded for a while: the gathered layers, FSDP2's root module, one layer's gradients for the
    reduce-scatter."""
    dims, cb, ft = setup.dims, setup.compute_bytes, setup.finetune
    shard = dims.rank_shard(setup.seq_len)
    comps: list[Component] = []
    # What FSDP all-gathers of one layer: its compute-dtype copy; with adapters the frozen layer (NF4 linears under
    # QLoRA) and its adapters (llmctl.plan.memory.adapters).
    gathered = lora.gathered_layer_bytes(spec, setup, layer_params)
    sharded_params = setup.engine == "fsdp2" or dims.zero_stage == 3
    fsdp = dims.fsdp_shard
    if sharded_params and fsdp > 1:
        # FSDP all-gathers a layer's parameters in the compute dtype just before use and frees them after;
        # with prefetch, the next layer is gathered while the current one computes: two layers live.
        # SHARD_GRAD_OP (reshard_after_forward=False) keeps every layer unsharded from forward to backward.
        n_layers = stage_layers if dims.zero_stage == 2 else min(2, stage_layers)
        name, unsharded = "unsharded layers (FSDP all-gather)", int(n_layers * gathered * (1 - 1 / fsdp))
        if setup.ep > 1:  # the experts' group unshards to E/ep experts over efsdp (llmctl.plan.memory.experts)
            unsharded = int(n_layers * ex.gathered_layer_bytes(spec, setup))
        if setup.precision.float8_all_gather and setup.engine == "fsdp2":
            # torchao's float8 all-gather: the converted linears' weights arrive (and stay until resharded) in float8.
            name = "unsharded layers (FSDP float8 all-gather)"
            unsharded = int(n_layers * f8.unsharded_layer_bytes(spec, cb, shard.tensor_ranks) * (1 - 1 / fsdp))
        comps.append(Component(name, unsharded, ("forward", "backward")))
    wrapped = setup.engine == "fsdp2" and setup.fsdp_wraps
    if wrapped and setup.pp == 1:
        # FSDP2 applied (llmctl.engine.parallelize.needs_fsdp). Tied embeddings: the root module (embeddings, final
        # norm, LM head) stays unsharded in the compute dtype from its forward to its backward (FSDP2 does not
        # reshard the root after forward). Measured on an H100 at one rank (docs/measurements/h100-gpu-tier.json):
        # 0.66 GiB for Llama-3.2-1B (tied), this term 0.71 GiB. Untied: the engine makes the embeddings a unit of
        # their own (gathered only for their forward and at the end of backward, away from the peak) and the final
        # norm + LM head another, gathered from the end of forward into backward; the root keeps what is left
        # (learned positions). On one rank the layers' compute-dtype copies are whole: two layers (current, prefetched).
        if spec.tie_embeddings:
            name, held = "unsharded root module (embeddings, LM head)", spec.embedding_params + spec.head_params
        else:
            positions = spec.embedding_params - spec.vocab_size * spec.hidden_size
            name, held = "unsharded final norm + LM head", spec.head_params + max(0, positions)
        comps.append(Component(name, int(shard.params(held) * cb), ("forward", "backward")))
        if fsdp == 1:
            two = int(min(2, stage_layers) * gathered)
            comps.append(Component("unsharded layers (FSDP2 on one rank)", two, ("forward", "backward")))
    elif setup.engine == "fsdp2" and ft.adapters and setup.precision.mixed:
        # One rank without FSDP2 (llmctl.spec.setup.fsdp_wraps) runs under torch.autocast: each fp32 adapter is cast
        # to the compute dtype at its use and the copy kept for its backward (the frozen base is in it already).
        n = int(shard.params(adapter_params(spec, ft)) * cb)
        comps.append(Component("adapters in the compute dtype (autocast)", n, ("forward", "backward")))
    if setup.training and fsdp > 1:
        # Backward: one layer's full gradients in the compute dtype, upcast to fp32 for the reduce-scatter.
        # With adapters only the adapters' gradients exist (the frozen base's need none).
        grads = ex.local_layer_params(spec, setup, layer_params)  # at ep > 1 the experts at E/ep
        grads = lora.adapter_layer_params(spec, ft) if ft.adapters else grads
        grad_buf = int(grads * (cb + 4 if cb != 4 else 4))
        comps.append(Component("unsharded layer gradients (reduce-scatter)", grad_buf, ("backward",)))
    return comps


# Activations under tensor parallelism: llmctl's engine (fsdp2) runs torch's sequence parallelism, whose layout the
# activation functions give per rank (tp=sp: the all-gathered inputs of q/k/v and gate/up kept whole, the norms on s/tp
# tokens, attention and MLP internals on this rank's heads and columns, rotary tables and masks whole:
# llmctl.plan.memory.activations, measured by tests/engine/test_tp_activations.py). Megatron-LM's sequence parallelism
# (the zero engine's DeepSpeed/Megatron stacks) keeps only the sharded inputs and re-gathers them in backward:
# everything divides by tp (Korthikanti et al. 2022), which is what `rest` does. A model measured on fake tensors has
# no layout: divided by tp too.
# Context parallelism: every activation is this rank's S/cp tokens of each sequence (input ids, labels and RoPE
# positions are split along the sequence, so are the rotary tables and the logits); the ring's own buffers come after
# (llmctl.plan.memory.ring).
def sequence_parallel_degree(spec: ModelSpec, setup: TrainSetup) -> int:
    """The tp degree the activation functions lay out per rank (torch's sequence parallelism), 1 where everything
    divides by tp instead (the comment above)."""
    return setup.dims.rank_shard(setup.seq_len).tensor_ranks if setup.engine == "fsdp2" and spec.measured is None else 1


def _forward_only_components(spec: ModelSpec, setup: TrainSetup) -> list[Component]:
    """Without training: one layer's activations at a time and the logits."""
    shard = setup.dims.rank_shard(setup.seq_len)
    b, s, cb = setup.micro_batch_size, shard.tokens, setup.compute_bytes
    sp = sequence_parallel_degree(spec, setup)
    one_layer = max(layer_activation_bytes(spec, b, s, cb, setup.attention, la, tp=sp) for la, _ in spec.layer_groups)
    one_layer //= shard.tensor_ranks // sp
    return [
        Component("activations (one layer, forward only)", one_layer, ("forward",)),
        Component("logits", shard.whole_columns(cb * b * s * spec.vocab_size), ("forward",)),
    ]


def _saved_activation_components(spec: ModelSpec, setup: TrainSetup, stage_layers: int) -> list[Component]:
    """What the stage saves for backward (every layer's, the shared tensors, the adapters' changes), context
    parallelism's second attention output, the block recomputed in backward, and the LM head's input."""
    shard = setup.dims.rank_shard(setup.seq_len)
    b, s, cb = setup.micro_batch_size, shard.tokens, setup.compute_bytes
    ck, attn, ft = setup.checkpointing, setup.attention, setup.finetune
    sp = sequence_parallel_degree(spec, setup)
    rest = shard.tensor_ranks // sp
    # pp 1 (pipeline parallelism: _pipeline_activation_components)
    saved = stage_activation_bytes(spec, stage_layers, b, s, cb, attn, ck, sp) // rest
    # Context parallelism passes each sequence's own positions (b rows), so the rotary tables have b rows too.
    rows = b if shard.split_sequences else 1
    saved += shared_activation_bytes(spec, b, s, cb, attn, position_rows=rows) // rest
    kept = _layers_saved_whole(ck, stage_layers)
    if ft.adapters:  # tp = pp = 1 with adapters (TrainSetup refuses the others)
        saved += lora.stage_adapter_delta(spec, stage_layers, b, s, cb, attn, ck, ft, kept)
    what = {"none": "saved for backward", "full": "block inputs, checkpointed"}.get(ck, f"{ck} checkpointing")
    what += ", measured on fake tensors" if spec.measured is not None else ""
    note = f"tp {sp}: torch sequence parallelism, colwise inputs gathered whole" if sp > 1 else ""
    comps = [Component(f"activations ({what})", saved, ("forward", "backward"), note=note)]
    copy = ring_output_copy_bytes(spec, setup)
    if copy and kept:
        comps.append(
            Component(
                "activations (ring attention: a second attention output per layer)",
                kept * copy,
                ("forward", "backward"),
                note=RING_COPY_NOTE,
            )
        )
    if ck != "none":
        rec = recompute_buffer_bytes(spec, b, s, cb, attn, ck, sp) // rest + copy
        if ft.adapters and ck != "selective":
            rec += max(lora.adapter_layer_delta(spec, la, b, s, cb, attn, ft) for la, _ in spec.layer_groups)
        comps.append(Component("recomputed block (backward)", rec, ("backward",)))
    comps += ep_activation_components(spec, setup, [(range(spec.num_layers), 1)])
    head = head_activation_bytes(spec, b, s, cb, sp) // rest
    if ft.adapters and spec.measured is None:
        head += lora.head_delta(spec, b, s, cb)
    comps.append(Component("final norm + LM-head input", head, ("forward", "backward")))
    return comps


def _loss_components(spec: ModelSpec, setup: TrainSetup) -> list[Component]:
    """The loss's buffers: one chunk's, or the whole b*s*V log-softmax, logits and their gradients."""
    shard = setup.dims.rank_shard(setup.seq_len)
    b, s, cb = setup.micro_batch_size, shard.tokens, setup.compute_bytes
    # Under torch's tensor parallelism the engine computes the loss on the LM head's vocabulary shards
    # (loss_parallel, llmctl.engine.loss.select_loss) whatever loss_chunk_tokens says: no chunks.
    chunk = 0 if sequence_parallel_degree(spec, setup) > 1 else min(setup.loss_chunk_tokens, b * s)
    if chunk:
        fwd_chunk = shard.whole_columns(loss_chunk_forward_bytes(spec, chunk, cb))
        bwd_chunk = shard.whole_columns(loss_chunk_backward_bytes(spec, chunk, cb))
        return [
            Component(f"loss chunk of {chunk} tokens (forward)", fwd_chunk, ("forward",)),
            Component(f"loss chunk of {chunk} tokens (backward)", bwd_chunk, ("loss_backward",)),
        ]
    # The loss keeps its fp32 log-softmax for backward; the logits (and their fp32 upcast) live only until the loss is
    # computed (the engine's whole_loss, and HF Trainer's compute_loss, drop them before backward). Under tp each
    # rank's are its V/tp vocabulary columns (loss_parallel's log-softmax, measured).
    bsv = shard.whole_columns(b * s * spec.vocab_size)
    return [
        Component("loss log-softmax (fp32, b*s*V)", 4 * bsv, ("forward", "loss_backward")),
        Component("logits (b*s*V, until the loss)", (cb + (4 if cb != 4 else 0)) * bsv, ("forward",)),
        # Backward through the loss: fp32 grad of the log-softmax and of the logits (2 x 4*b*s*V) live at once.
        Component("loss backward buffers", 8 * bsv, ("loss_backward",)),
    ]


def _foreach_temporaries(states: list[Component]) -> Component:
    """torch's foreach AdamW materialises per-group temporaries about the size of the local fp32 shard (on the host
    under CPU offload, where the step runs): the first trained state line's bytes."""
    shard = next(c.bytes for c in states if c.bytes_per_param is not None and not c.name.startswith("frozen"))
    return Component("optimizer step temporaries (foreach)", shard, ("optimizer",))


def _one_layer_transients(spec: ModelSpec, setup: TrainSetup) -> list[Component]:
    """Buffers of the one layer running at a time: QLoRA's dequantized weight, the ring's, float8's copies."""
    comps: list[Component] = []
    if dequant := lora.dequantized_linear_bytes(spec, setup):
        comps.append(Component(QLORA_DEQUANT, dequant, ("forward", "backward") if setup.training else ("forward",)))
    if setup.dims.cp_enabled:
        comps += ring_components(spec, setup)
    if setup.precision.float8:
        comps += float8_components(spec, setup)
    return comps


PHASES = ("forward", "loss_backward", "backward", "optimizer")
LAYER_BACKWARD_ONLY = (
    "recomputed block (backward)",
    "unsharded layer gradients (reduce-scatter)",
    "ring attention",
    "float8 copies",
    "offload: one layer's gradient shard",
    "QLoRA: one linear's weight dequantized",
    ex.EP_BUFFERS,
)
"""Components live only while a layer's backward runs (prefixes of their names): not during the loss's backward."""


def memory_key(setup: TrainSetup) -> TrainSetup:
    """The setup as far as memory depends on it: accumulation only as whether there is any (gradients live in the
    forward then), not compile or async TP. What the planner caches estimates under."""
    return replace(setup, grad_accum_steps=min(setup.grad_accum_steps, 2), compile=False, async_tp=False)


def _in_loss_backward_all(comps: list[Component], setup: TrainSetup) -> list[Component]:
    """Where each component lives in the loss's backward: what is live in the layers' backward too, except the
    layer-only buffers; the gradients only with accumulation (the engine frees them after each step: the first
    micro-batch's forward and loss backward have none). The zero engine (DeepSpeed) keeps its gradient buffers
    allocated. A new Component directly where the phases change (dataclasses.replace costs more than the rest)."""
    no_grads = setup.engine == "fsdp2" and setup.grad_accum_steps == 1
    out = []
    for c in comps:
        key = (c.name, c.phases, no_grads)
        phases = _LOSS_PHASES.get(key)
        if phases is None:
            phases = _LOSS_PHASES[key] = _loss_phases(c.name, c.phases, no_grads)
        out.append(c if phases == c.phases else Component(c.name, c.bytes, phases, c.bytes_per_param, c.note))
    return out


_LOSS_PHASES: dict[tuple[str, tuple[str, ...], bool], tuple[str, ...]] = {}
"""_loss_phases by (name, phases, no gradients kept): the planner asks it for ~30 components of each of thousands of
estimates, from a few dozen distinct inputs."""


def _loss_phases(name: str, phases: tuple[str, ...], no_grads: bool) -> tuple[str, ...]:
    out = phases
    if "backward" in out and not name.startswith(LAYER_BACKWARD_ONLY):
        out = (*out, "loss_backward")
    if name.startswith("gradients") and no_grads:
        out = tuple(p for p in out if p in ("backward", "optimizer"))
    return phases if out == phases else tuple(p for p in PHASES if p in out)


QLORA_DEQUANT = "QLoRA: one linear's weight dequantized (compute dtype)"
OFFLOAD_COPY_IN = "offload: one layer's shard copied in"
OFFLOAD_GRAD_OUT = "offload: one layer's gradient shard before its copy out"


def offload_components(setup: TrainSetup, layer_params: float) -> list[Component]:
    """What CPU offload puts on the GPU instead of the states (module docstring): one layer's shard copied in from
    the host with its cast to the compute dtype, and one layer's reduced gradient shard before its copy out."""
    p = setup.precision
    shard = layer_params / setup.dims.fsdp_shard
    cast = p.compute_bytes if p.compute_dtype != p.param_dtype else 0
    how = f"{p.param_dtype} from the host" + (f", cast to {p.compute_dtype} for the all-gather" if cast else "")
    out = [Component(OFFLOAD_COPY_IN, int(shard * (p.param_bytes + cast)), ("forward", "backward"), note=how)]
    if setup.training:
        out.append(Component(OFFLOAD_GRAD_OUT, int(shard * p.reduce_bytes), ("backward",), note=f"{p.reduce_dtype}"))
    return out


RING_COPY_NOTE = (
    "head-tail load balance: the ring's partial update (torch.cat) leaves the merged output contiguous as "
    "(b, heads, s, d), so transformers' transpose(1, 2).contiguous() before o_proj copies it (the last cp rank's "
    "does not; the estimate is the worst rank's)"
)


def ring_output_copy_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Under context parallelism with the head-tail load balance, what one layer keeps beyond the usual attention
    output on every cp rank but the last (RING_COPY_NOTE; measured by tests/engine/test_tp_activations.py): o_proj's
    input, a copy of the output, b x S/cp x this rank's heads x value head size (the largest layer's). 0 otherwise."""
    shard = setup.dims.rank_shard(setup.seq_len)
    if not shard.split_sequences or not setup.cp_load_balance or spec.measured is not None:
        return 0
    b, s = setup.micro_batch_size, shard.tokens
    heads = max(shard.columns(la.attention.num_heads) * la.attention.v_head_dim for la, _ in spec.layer_groups)
    return setup.compute_bytes * b * s * heads


def _layers_saved_whole(checkpointing: str, layers: int) -> int:
    """Layers of a stage whose forward tensors are all saved (not checkpointed): every one without checkpointing,
    none with full or selective (selective regenerates the copy), those partial:K leaves alone."""
    if checkpointing == "none":
        return layers
    if ckpt_modes.partial_every(checkpointing):
        return layers - len(ckpt_modes.whole_layers(checkpointing, layers))
    return 0


FLOAT8_NOTE = (
    "torchao frees each float8 copy after its matmul and saves the bf16 input and weight for backward, as nn.Linear "
    "does (matmul_with_hp_or_float8_args): the activations are bf16-mixed's"
)


def float8_components(spec: ModelSpec, setup: TrainSetup) -> list[Component]:
    """The float8 copies the largest converted linear makes while it runs (llmctl.plan.float8.transient_bytes): its
    input and weight in forward, grad_output twice, the weight and the input in backward, with their scales (the
    float8 all-gather's one precomputed fp32 scale a weight is a few bytes, not a line)."""
    rank = setup.dims.rank_shard(setup.seq_len)
    tokens = setup.micro_batch_size * setup.seq_len // rank.ring_ranks
    shard = setup.dims.fsdp_shard if setup.engine == "fsdp2" else 1
    fwd, bwd = f8.transient_bytes(spec, setup.precision, tokens, rank.tensor_ranks, shard)
    if not fwd:  # no linear converts (GPT-2's Conv1D, a model measured on fake tensors)
        return []
    out = [Component("float8 copies of one linear (forward)", fwd, ("forward",), note=FLOAT8_NOTE)]
    if setup.training:
        out.append(Component("float8 copies of one linear (backward)", bwd, ("backward",), note=FLOAT8_NOTE))
    return out


RING_FORWARD_KV = "ring attention K/V in flight (forward)"
RING_FORWARD_MERGE = "ring attention fp32 merge (forward)"
RING_BACKWARD_KV = "ring attention K/V in flight (backward)"
RING_BACKWARD_GRADS = "ring attention fp32 gradients + dK/dV rotation (backward)"


def ring_components(spec: ModelSpec, setup: TrainSetup) -> list[Component]:
    """Context parallelism's ring attention, while one layer's attention runs (llmctl.plan.memory.ring): its K/V blocks
    in flight and its fp32 working set, forward (and backward when training)."""
    ring = ring_buffers(spec, setup)
    how = f"cp {setup.dims.rank_shard(setup.seq_len).ring_ranks}, {setup.cp_rotate} rotation" + (
        "" if setup.cp_load_balance else ", no load balance"
    )
    out = [
        Component(RING_FORWARD_KV, ring.forward_kv, ("forward",), note=how),
        Component(RING_FORWARD_MERGE, ring.forward_merge, ("forward",), note=how),
    ]
    if setup.training:
        again = "; the recompute's forward ring (larger than the backward's)" if ring.backward_is_recompute else ""
        out.append(Component(RING_BACKWARD_KV, ring.backward_kv, ("backward",), note=how + again))
        out.append(Component(RING_BACKWARD_GRADS, ring.backward_grads, ("backward",), note=how + again))
    return out


def fits(est: MemoryEstimate, device_memory_bytes: int, host_memory_bytes: int | None = None) -> bool:
    """The device bytes within the GPU's memory and, under CPU offload with a host capacity per GPU given, the host
    bytes within it."""
    host_ok = host_memory_bytes is None or est.host_bytes <= host_memory_bytes
    return est.device_bytes <= device_memory_bytes and host_ok


def host_capacity_bytes(gpu: GPUSpec | None, gpus_per_node: int, node_memory_gib: float | None = None) -> int | None:
    """Host memory per GPU a job may fill (CPU offload's check): a node's memory (a cluster file's node_memory_gib)
    over its GPUs, else the GPU catalog's node_memory_gib_per_gpu for the kind; None where neither is known."""
    if node_memory_gib is not None:
        return int(node_memory_gib * GIB / gpus_per_node)
    if gpu is not None and gpu.node_memory_gib_per_gpu is not None:
        return gpu.node_memory_gib_per_gpu * GIB
    return None


def max_micro_batch(
    spec: ModelSpec,
    setup: TrainSetup,
    device_memory_bytes: int,
    limit: int = 65536,
    host_memory_bytes: int | None = None,
    one: MemoryEstimate | None = None,
) -> int:
    """Largest micro-batch that fits (0 if none). Memory is non-decreasing in b and close to linear (activations grow
    with b, states do not; the chunked loss's lines stop growing at one chunk): a first guess from the slope between
    b=1 and b=2, then a bracket around it and a binary search to the exact boundary (3-6 estimates, not 2 log2(b))."""

    def fit(b: int) -> bool:
        return fits(estimate(spec, replace(setup, micro_batch_size=b)), device_memory_bytes)

    if one is None or one.setup.micro_batch_size != 1:  # `one`: the caller's estimate at micro-batch 1, if it has it
        one = estimate(spec, replace(setup, micro_batch_size=1))
    if not fits(one, device_memory_bytes, host_memory_bytes):  # the host's bytes do not grow with the micro-batch
        return 0
    if limit < 2:
        return 1
    two = estimate(spec, replace(setup, micro_batch_size=2))
    if not fits(two, device_memory_bytes):
        return 1
    slope = two.device_bytes - one.device_bytes
    guess = limit if slope <= 0 else min(limit, max(2, 1 + (device_memory_bytes - one.device_bytes) // slope))
    # Bracket: lo fits, hi does not (or hi = limit + 1), widening geometrically from the guess.
    if fit(guess):
        lo, step = guess, 1
        hi = lo + step
        while hi <= limit and fit(hi):
            lo, step = hi, step * 2
            hi = lo + step
        hi = min(hi, limit + 1)
    else:
        hi, step = guess, 1
        lo = max(2, hi - step)
        while lo > 2 and not fit(lo):
            hi, step = lo, step * 2
            lo = max(2, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fit(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class MinGpus:
    strategy: str
    gpus: int | None
    """Fewest GPUs that fit (None: no count of this GPU kind fits)."""
    nodes: int | None
    device_bytes: int | None
    """Per-GPU requirement at that count."""
    note: str = ""


def min_gpus(
    spec: ModelSpec,
    setup: TrainSetup,
    device_memory_bytes: int,
    strategy: str,
    max_nodes: int = 4096,
    host_memory_bytes: int | None = None,
) -> MinGpus:
    """Fewest GPUs of this kind (whole nodes beyond one) on which `strategy` fits at the setup's micro-batch (and,
    under CPU offload, its host bytes per GPU within `host_memory_bytes` where given)."""
    gpn = setup.gpus_per_node
    strategy = canonical_strategy(strategy)
    if setup.engine == "fsdp2" and strategy == "zero1":
        return MinGpus(strategy, None, None, None, "needs --engine zero")
    unit = setup.dims.batch_sharers * setup.pp  # the ranks of one model replica

    def est_at(nodes: int, per_node: int) -> MemoryEstimate:
        return estimate(spec, replace(setup, strategy=strategy, nodes=nodes, gpus_per_node=per_node))

    if strategy == "hybrid_shard":
        if gpn % setup.dims.batch_sharers:
            what = "tp x cp" if setup.dims.cp_enabled else "tp"
            return MinGpus(strategy, None, None, None, f"{what} does not divide GPUs per node")
        # Two replicas of the shard group; a pipeline may span nodes (pp x tp over gpus per node of them each).
        nodes = 2 * -(-unit // gpn)
        if nodes * gpn % unit:
            return MinGpus(strategy, None, None, None, "tp x pp does not divide the GPUs of whole nodes")
        try:
            if not ep_borrows(setup, strategy, nodes, gpn):
                return MinGpus(strategy, None, None, None, f"ep {setup.ep} does not divide a node's dp_shard x cp")
            e = est_at(nodes, gpn)
        except RuleError as err:  # a pipeline leaves fewer data-parallel ranks than a node's shard group
            return MinGpus(strategy, None, None, None, err.message)
        if fits(e, device_memory_bytes, host_memory_bytes):
            return MinGpus(strategy, nodes * gpn, nodes, e.device_bytes, "memory does not shrink with more nodes")
        return MinGpus(strategy, None, None, e.device_bytes, "does not fit when sharded over one node")
    # Inside one node: unit, 2*unit, ... up to gpus_per_node.
    for n in range(unit, gpn + 1, unit):
        if (gpn % n and n != gpn) or not ep_borrows(setup, strategy, 1, n):
            continue
        e = est_at(1, n)
        if fits(e, device_memory_bytes, host_memory_bytes):
            return MinGpus(strategy, n, 1, e.device_bytes)
    # A replica spans whole nodes when a pipeline (tp x cp x pp) is larger than one: node counts are its multiples.
    step = unit // gpn if unit > gpn and unit % gpn == 0 else 1
    if (step := _ep_node_step(setup, strategy, step)) is None:
        return MinGpus(strategy, None, None, None, f"ep {setup.ep} divides the dp_shard x cp of no node count")
    if strategy == "no_shard" and (gpn % unit == 0 or step > 1):
        e = est_at(step, gpn)
        return MinGpus(strategy, None, None, e.device_bytes, "replicated states do not shrink with more GPUs")
    # Whole nodes: memory is non-increasing in nodes for sharded strategies; binary search.
    most = max_nodes // step * step
    if (gpn % unit and step == 1) or not fits(est_at(most, gpn), device_memory_bytes, host_memory_bytes):
        e = est_at(most, gpn) if gpn % unit == 0 or step > 1 else None
        return MinGpus(
            strategy,
            None,
            None,
            e.device_bytes if e else None,
            f"does not fit even on {most} nodes"
            if e
            else f"tp x {'cp x ' if setup.dims.cp_enabled else ''}pp does not divide GPUs per node",
        )
    # lo: does not fit (one node checked above with n = gpn; none when a replica spans nodes), hi: fits (in replicas)
    lo, hi = (1 if step == 1 else 0), most // step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(est_at(mid * step, gpn), device_memory_bytes, host_memory_bytes):
            hi = mid
        else:
            lo = mid
    e = est_at(hi * step, gpn)
    return MinGpus(strategy, hi * step * gpn, hi * step, e.device_bytes)


def ep_borrows(setup: TrainSetup, strategy: str, nodes: int, per_node: int) -> bool:
    """Whether the setup's ep divides the dp_shard x cp ranks it borrows from (llmctl.spec.parallel.ParallelDims) on
    `nodes` x `per_node` GPUs: the GPU counts the fewest-GPUs search may try (a pinned ep skips the others)."""
    if setup.ep == 1:
        return True
    dims = replace(setup, strategy=strategy, nodes=nodes, gpus_per_node=per_node, ep=1).dims
    return dims.fsdp_shard % setup.ep == 0


def _ep_node_step(setup: TrainSetup, strategy: str, step: int) -> int | None:
    """The whole-node step of the fewest-GPUs search (`step`: a replica's) made a multiple on which ep divides
    dp_shard x cp: the node counts n x step where it does are the multiples of the smallest such n (None: none)."""
    for k in range(1, setup.ep + 1):
        if ep_borrows(setup, strategy, k * step, setup.gpus_per_node):
            return k * step
    return None


# --- pipeline parallelism: one estimate per pp rank ---------------------------------------------------------------
PP_UNSHARDED_PARAMS = "unsharded parameters (pp: kept until the schedule's end)"
PP_UNSHARDED_GRADS = "unsharded gradients (pp: accumulated until the schedule's reduce-scatter)"
PP_STAGE_OUTPUTS = "stage outputs kept for backward (pipelining fwd_cache)"
PP_RECV_BUFFERS = "P2P receive buffers (activations and gradients, one per micro-batch)"
PP_INPUT_GRADS = "P2P input gradients (until the next step)"
PIPELINE_NOTE = (
    "torch.distributed.pipelining under FSDP2: no gradient sync nor reshard after each micro-batch's backward, one "
    "reduce-scatter after the schedule's last (stage.py backward_maybe_with_nosync, perform_reduce_grad)"
)


def _pipeline_estimate(spec: ModelSpec, setup: TrainSetup) -> MemoryEstimate:
    """Every pp rank's estimate (llmctl.plan.memory.pipeline); the heaviest is the answer, carrying them all."""
    ranks = pl.pipeline_ranks(spec, setup)
    ests = pipeline_rank_estimates(spec, setup, ranks)
    worst = max(range(len(ests)), key=lambda i: (ests[i].device_bytes, -i))
    return replace(ests[worst], pipeline_rank=worst, rank_estimates=tuple(ests))


def pipeline_rank_estimates(
    spec: ModelSpec, setup: TrainSetup, ranks: tuple[pl.PipelineRank, ...] | None = None
) -> list[MemoryEstimate]:
    """Each pp rank's own estimate, in rank order (`estimate` answers with the heaviest); `ranks`: the setup's
    pipeline_ranks where the caller has them."""
    _check_estimable(setup)
    ledger = state_ledger(spec, setup)
    return [_rank_estimate(spec, setup, ledger, r) for r in (ranks or pl.pipeline_ranks(spec, setup))]


def _rank_estimate(
    spec: ModelSpec, setup: TrainSetup, ledger: list[StateLine], prank: pl.PipelineRank
) -> MemoryEstimate:
    """One pp rank's estimate: its states (its exact parameters), its unsharded copies, its in-flight activations and
    the pipeline's buffers, the loss's on the rank holding the head."""
    held = pl.rank_params(spec, setup, prank)
    ledger = [
        replace(line, rank_bytes=adam_8bit_pipeline_rank_bytes(spec, setup, prank)) if line.rank_bytes else line
        for line in ledger
    ]
    experts = ex.held_expert_params(spec, setup, prank.blocks) if setup.ep > 1 else 0.0
    comps, host = _state_components(setup, ledger, held, experts)
    layer_params = setup.dims.rank_shard(setup.seq_len).params(spec.params_per_layer)
    comps += _pipeline_fsdp_components(spec, setup, prank, held, layer_params)
    if setup.levers.offload:
        comps += offload_components(setup, layer_params)
    if setup.training:
        comps += _pipeline_activation_components(spec, setup, prank)
        if prank.head:
            comps += _pipeline_loss_components(spec, setup, prank)
        if not setup.fused_optimizer:
            (host if setup.levers.offload else comps).append(_foreach_temporaries(comps + host))
    else:
        comps += [c for c in _forward_only_components(spec, setup) if prank.head or c.name != "logits"]
    comps += _one_layer_transients(spec, setup)
    if setup.training:
        comps = _in_loss_backward_all(comps, setup)
        if setup.pipeline_microbatches == 1:  # one micro-batch: its loss's backward comes before any gradient
            comps = [_without_loss_backward(c) if c.name == PP_UNSHARDED_GRADS else c for c in comps]
    phases = _phase_bytes(comps)
    if not setup.training:
        phases = {"forward": phases["forward"]}
    return MemoryEstimate(
        spec=spec, setup=setup, components=comps, phase_bytes=phases, ledger=ledger, host_components=host
    )


def _without_loss_backward(c: Component) -> Component:
    return Component(c.name, c.bytes, tuple(p for p in c.phases if p != "loss_backward"), c.bytes_per_param, c.note)


def _pipeline_fsdp_components(
    spec: ModelSpec, setup: TrainSetup, prank: pl.PipelineRank, held: int, layer_params: float
) -> list[Component]:
    """What FSDP keeps unsharded on a pp rank. FSDP2 (PIPELINE_NOTE; torchtitan: no reshard after forward under pp):
    the rank's parameters whole in the compute dtype (float8 for the converted linears under the float8 all-gather)
    from the first forward to the schedule's end, their gradients whole in the reduce dtype from the first backward to
    the reduce-scatter. ZeRO: as at pp 1, over the rank's blocks."""
    dims, cb, p = setup.dims, setup.compute_bytes, setup.precision
    blocks = len(prank.blocks)
    if setup.engine != "fsdp2":
        return _fsdp_components(spec, setup, blocks, layer_params)
    wrapped = dims.fsdp_shard > 1 or dims.dp_replicate > 1 or p.mixed or setup.levers.offload
    if not wrapped:
        return []
    local = ex.local_held_params(spec, setup, held, prank.blocks)  # at ep > 1 the experts at E/ep
    unsharded = local * cb
    if p.float8_all_gather:
        shard = setup.dims.rank_shard(setup.seq_len)
        f8_layer = f8.unsharded_layer_bytes(spec, cb, shard.tensor_ranks)
        unsharded += blocks * (f8_layer - layer_params * cb)
    comps = [Component(PP_UNSHARDED_PARAMS, int(unsharded), ("forward", "backward"), note=PIPELINE_NOTE)]
    if setup.training:
        grad_bytes = p.reduce_bytes if p.reduce_dtype != p.compute_dtype else cb
        phases = ("forward", "backward") if setup.pipeline_microbatches > 1 else ("backward",)
        comps.append(Component(PP_UNSHARDED_GRADS, int(local * grad_bytes), phases, note=PIPELINE_NOTE))
    return comps


def _pipeline_activation_components(spec: ModelSpec, setup: TrainSetup, prank: pl.PipelineRank) -> list[Component]:
    """A pp rank's saved activations: each of its stages' micro-batches in flight (llmctl.plan.memory.pipeline), each
    its blocks', the shared tensors its forward builds, the input ids on the first stage, the LM head's input on the
    last; the stage outputs kept for backward and torch's P2P buffers; the block recomputed in backward."""
    shard = setup.dims.rank_shard(setup.seq_len)
    b, s, cb = setup.micro_batch_size, shard.tokens, setup.compute_bytes
    ck, attn, m = setup.checkpointing, setup.attention, setup.pipeline_microbatches
    sp = sequence_parallel_degree(spec, setup)
    rest = shard.tensor_ranks // sp
    boundary = pl.boundary_bytes(setup, spec.hidden_size)
    rows = b if shard.split_sequences else 1
    shared = shared_activation_bytes(spec, b, s, cb, attn, position_rows=rows) // rest
    saved = ids = head = outputs = kept = 0
    for h in prank.held:
        blocks, n = h.part.blocks, h.micro_batches
        unit = stage_blocks_saved_bytes(spec, blocks, b, s, cb, attn, ck, sp, input_whole=h.part.embedding) // rest
        if h.receives and len(blocks) and stage_block_mode(ck, len(blocks), 0) != "none":
            unit -= boundary  # the first block's checkpointed input is the receive buffer, counted below
        saved += n * (unit + (shared if len(blocks) else 0))
        kept += n * _layers_saved_whole(ck, len(blocks))
        ids += n * input_ids_bytes(spec, b, s) // rest if h.part.embedding else 0
        head += (
            n * (head_activation_bytes(spec, b, s, cb, sp) - input_ids_bytes(spec, b, s)) // rest if h.part.head else 0
        )
        outputs += n * boundary if h.sends else 0
    what = {"none": "saved for backward", "full": "block inputs, checkpointed"}.get(ck, f"{ck} checkpointing")
    what += ", measured on fake tensors" if spec.measured is not None else ""
    note = f"{prank.in_flight} stage-micro-batches in flight ({setup.pp_schedule}, m {m}, stages {prank.label()})"
    live = ("forward", "backward")
    comps = [Component(f"activations ({what})", saved, live, note=note)]
    if copy := ring_output_copy_bytes(spec, setup):
        comps.append(Component("activations (ring attention: a second attention output per layer)", kept * copy, live))
    if ids:
        comps.append(Component("input ids (first stage)", ids, live))
    if outputs:
        comps.append(Component(PP_STAGE_OUTPUTS, outputs, live))
    comps += _p2p_buffer_components(setup, prank, boundary)
    if ck != "none" and prank.blocks:
        rec = recompute_buffer_bytes(spec, b, s, cb, attn, ck, sp) // rest + copy
        comps.append(Component("recomputed block (backward)", rec, ("backward",)))
    comps += ep_activation_components(spec, setup, [(h.part.blocks, h.micro_batches) for h in prank.held])
    if head:
        comps.append(Component("final norm + LM-head input", head, live))
    return comps


def ep_activation_components(
    spec: ModelSpec, setup: TrainSetup, stages: list[tuple[Sequence[int], int]]
) -> list[Component]:
    """At ep > 1 (llmctl.plan.memory.experts): what the engine's dispatch keeps for backward over the ep 1 experts'
    loop, for each (blocks, micro-batches in flight) of the rank's stages; the recomputed block's under
    checkpointing; one MoE layer's dispatch buffers in flight. None at ep 1."""
    if setup.ep == 1 or not any(ex.dispatches(spec, la) for la, _ in spec.layer_groups):
        return []
    tokens = setup.micro_batch_size * setup.dims.rank_shard(setup.seq_len).tokens
    live, note = ("forward", "backward"), ex.IMBALANCE_NOTE
    saved = sum(n * ex.stage_saved_delta(spec, setup, blocks, tokens) for blocks, n in stages)
    comps = [Component(ex.EP_SAVED, saved, live, note=note)] if saved else []
    if setup.checkpointing != "none":
        one = max(ex.saved_delta_bytes(spec, setup, la, tokens) for la, _ in spec.layer_groups)
        comps.append(Component(EP_RECOMPUTED, one, ("backward",), note=note))
    comps.append(Component(ex.EP_BUFFERS, ex.buffer_bytes(spec, setup, tokens), live, note=note))
    return comps


EP_RECOMPUTED = "recomputed block (backward): ep dispatch"


def _p2p_buffer_components(setup: TrainSetup, prank: pl.PipelineRank, boundary: int) -> list[Component]:
    """torch.distributed.pipelining's buffers (llmctl.plan.memory.pipeline): per micro-batch of a schedule run, a
    receive buffer for each receiving stage's input and for each sending stage's output gradient, kept all run; the
    received inputs' gradients until the next step."""
    m = setup.pipeline_microbatches
    receiving = sum(h.receives for h in prank.held)
    sending = sum(h.sends for h in prank.held)
    comps = [Component(PP_RECV_BUFFERS, m * boundary * (receiving + sending), ("forward", "backward", "optimizer"))]
    if receiving:
        phases = ("forward", "backward", "optimizer") if m > 1 else ("backward", "optimizer")
        comps.append(Component(PP_INPUT_GRADS, m * boundary * receiving, phases))
    return comps


PP_LOGITS_KEPT = "logits kept for backward (pipelining fwd_cache, b*s*V)"


def _pipeline_loss_components(spec: ModelSpec, setup: TrainSetup, prank: pl.PipelineRank) -> list[Component]:
    """The loss's buffers on the rank holding the head, the engine's whole loss (no chunks under pp): per micro-batch
    in flight on the last stage its saved fp32 log-softmax and its logits (the stage's output, which PipelineStage
    keeps in fwd_cache until that micro-batch's backward; with `step(return_outputs=False)`, as torchtitan runs it:
    otherwise `output_chunks` keeps every micro-batch's logits to the step's end); one at a time their fp32 upcast
    and the loss's backward buffers."""
    n = next(h.micro_batches for h in prank.held if h.part.head)
    shard = setup.dims.rank_shard(setup.seq_len)
    bsv = shard.whole_columns(setup.micro_batch_size * shard.tokens * spec.vocab_size)
    cb, live = setup.compute_bytes, ("forward", "backward")
    comps = [
        Component("loss log-softmax (fp32, b*s*V)", 4 * bsv * n, ("forward", "loss_backward")),
        Component(PP_LOGITS_KEPT, cb * bsv * n, live),
        Component("loss backward buffers", 8 * bsv, ("loss_backward",)),
    ]
    if cb != 4:
        comps.insert(2, Component("logits fp32 upcast (until the loss)", 4 * bsv, ("forward",)))
    return comps


def _stage_memory(spec: ModelSpec, setup: TrainSetup, est: MemoryEstimate, prank: pl.PipelineRank) -> StageMemory:
    """A pp rank's estimate by kind at its peak phase (estimate-memory's per-stage table)."""
    kinds = {"params": 0, "grads": 0, "states": 0, "activations": 0}
    for c in est.components:
        if est.peak_phase in c.phases:
            kinds[_kind(c)] += c.bytes
    return StageMemory(
        rank=prank.rank,
        stages=prank.stages,
        blocks=len(prank.blocks),
        params=pl.rank_params(spec, setup, prank),
        params_bytes=kinds["params"],
        grads_bytes=kinds["grads"],
        states_bytes=kinds["states"],
        activations_bytes=kinds["activations"],
        in_flight=prank.in_flight,
        peak_phase=est.peak_phase,
        device_bytes=est.device_bytes,
    )


def _kind(c: Component) -> str:
    """The kind of memory a component is, for the per-stage table."""
    if c.name.startswith(("gradients", "unsharded gradients", "unsharded layer gradients")):
        return "grads"
    if c.name.startswith("optimizer states"):
        return "states"
    if c.bytes_per_param is not None or c.name.startswith(
        ("unsharded parameters", "unsharded layers", "unsharded root", "unsharded final norm")
    ):
        return "params"
    return "activations"
