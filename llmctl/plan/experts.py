"""Expert parallelism's cost (torch-free): what an ep > 1 setup changes in a step, beside llmctl.spec.experts (what an
ep rank owns and sends) and llmctl.plan.network.alltoall_time (what an all-to-all costs on the links it crosses).

Compute (llmctl.plan.kernel_time.gemm_efficiency). At ep 1 transformers' expert loop runs one small matmul per expert
hit: each of the E experts a (tokens x k / E)-row gate_up and down, a kernel launch each. The engine's EP path runs
each MoE layer's local experts as two torch._grouped_mm over all the rows the rank received (gate_up, then down),
priced as one GEMM each, (rows x hidden x 2I) and (rows x I x hidden), at the efficiency model the module uses for
dense GEMMs (its width term and one call's overhead). Assumed: the grouped kernel reaches a dense GEMM's rate of the
same total shape, i.e. every local expert gets enough rows that its tiles are full (the balanced share, tokens x k x
ep / E rows per local expert, is thousands of rows at the micro-batches the planner times). The rows a rank receives
are `IMBALANCE` x its balanced share (tokens x k): the busiest rank sets the pace of the layer, so its expert FLOPs
are counted (`expert_flops_per_token`); 1.0 assumes the balanced router the load-balancing loss trains towards.

Communication (`ep_comm`). Per MoE layer per micro-batch: the dispatch and the combine in forward, and their
gradients in backward (the combine's backward sends the output gradients to the experts, the dispatch's backward
sends the input gradients back): 4 all-to-alls, each rank sending S = tokens x k x hidden x compute bytes (nccl-tests
alltoall's S, its own chunk counted; `alltoall_bytes`), the busiest rank's `IMBALANCE` x S priced. The counts
exchange before each dispatch (E integers a rank) is a few hundred bytes: not counted. A block that checkpointing
re-runs in backward re-runs its dispatch and combine: whole-block checkpointing in its recomputed blocks, selective
in every block (the engine's selective policy keeps no collective output, as for TP). Nothing hides them: the engine
runs them between the router and the grouped GEMM on the critical path (no overlap is assumed).

FSDP (llmctl.plan.comm.step_comm with `CommShape.expert_params`). The routed experts leave the dense FSDP group: each
rank gathers only its E/ep local experts, over the efsdp group (dp_shard x cp / ep ranks strided by ep,
llmctl.spec.parallel.ParallelDims.group_scope "efsdp"), and reduce-scatters their gradients there; the dense part is
gathered over dp_shard x cp as before. Each rank stores 1/(ep x efsdp) = 1/(dp_shard x cp) of the experts as it
stores the rest, so the replicas' all-reduce and the optimizer step are unchanged.
"""

from __future__ import annotations

from llmctl.plan import comm as cm
from llmctl.plan import flops as fl
from llmctl.plan import network
from llmctl.plan.memory.experts import layer_expert_params
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.experts import IMBALANCE
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.setup import TrainSetup

ALLTOALLS_PER_LAYER = 4
"""Per MoE layer per micro-batch: dispatch and combine forward, their gradients backward."""
ALLTOALLS_RECOMPUTED = 2
"""Per MoE layer that checkpointing re-runs: its forward's dispatch and combine again."""


def routed_expert_params(spec: ModelSpec, blocks: tuple[int, ...] | None = None) -> int:
    """Routed-expert parameters of the model, or of some blocks (a pipeline rank's)."""
    if spec.measured is not None:
        return 0
    return sum(n * layer_expert_params(layer, spec.hidden_size) for layer, n in spec.groups_of(blocks))


def moe_layer_count(spec: ModelSpec, blocks: tuple[int, ...] | None = None) -> int:
    """MoE layers of the model, or of some blocks."""
    if spec.measured is not None:
        return 0
    return sum(n for layer, n in spec.groups_of(blocks) if layer.mlp.moe)


def expert_flops_per_token(spec: ModelSpec) -> int:
    """Model FLOPs per token of the routed experts (forward and backward, 6 x the k experts' weights a token passes
    through per MoE layer): what `IMBALANCE` scales on the busiest ep rank."""
    total = 0
    for layer, n in spec.layer_groups:
        if layer.mlp.moe:
            total += (
                n * 6 * sum(i * o for name, i, o in layer.mlp.matmuls(spec.hidden_size) if name.startswith("expert"))
            )
    return total


def grouped_gemms(
    layer: Layer, hidden: int, tokens: float, imbalance: float = IMBALANCE
) -> list[tuple[float, int, int]]:
    """(rows, in, out) of the EP path's two grouped GEMMs of one MoE layer on one rank: gate_up over the rows it
    received (tokens x k x imbalance), then down."""
    m = layer.mlp
    rows = tokens * m.experts_per_token * imbalance
    return [(rows, hidden, 2 * m.intermediate_size), (rows, m.intermediate_size, hidden)]


def alltoall_bytes(tokens: float, top_k: int, hidden: int, compute_bytes: float, imbalance: float = IMBALANCE) -> float:
    """S of one dispatch (or combine, or either's gradient) on the busiest ep rank: its tokens x top-k rows of
    `hidden` elements in the compute dtype, x `imbalance` (module docstring)."""
    return tokens * top_k * hidden * compute_bytes * imbalance


def alltoall_calls(spec: ModelSpec, setup: TrainSetup, blocks: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(forward and backward all-to-alls, recomputed ones) per micro-batch on a rank holding `blocks` (None: all)."""
    moe = [i for i, layer in enumerate(spec.layers) if layer.mlp.moe and (blocks is None or i in blocks)]
    if setup.checkpointing == "selective":
        again = len(moe)
    else:
        whole = set(ckpt_modes.whole_layers(setup.checkpointing, spec.num_layers))
        again = sum(1 for i in moe if i in whole)
    return ALLTOALLS_PER_LAYER * len(moe), ALLTOALLS_RECOMPUTED * again


def ep_comm(
    spec: ModelSpec, setup: TrainSetup, seq_len: int, net: cm.Network, blocks: tuple[int, ...] | None = None
) -> cm.StepComm:
    """Expert parallelism's all-to-alls per optimizer step (none at ep 1), all exposed (module docstring); `blocks`:
    a pp rank's blocks (None: all)."""
    ep = setup.ep
    if ep <= 1 or spec.measured is not None:
        return cm.StepComm(ops=[], total_s=0.0, exposed_s=0.0, bottleneck="")
    tokens = setup.micro_batch_size * setup.dims.rank_shard(seq_len).tokens  # this rank's, a micro-batch
    first = next(layer for layer in spec.layers if layer.mlp.moe)
    size = alltoall_bytes(tokens, first.mlp.experts_per_token, spec.hidden_size, setup.compute_bytes, IMBALANCE)
    g = setup.gpus_per_node
    t = network.alltoall_time(net, size, ep, g)
    scope = "intra" if ep <= g and g % ep == 0 else "cross"
    bw = size * (ep - 1) / ep / (t * 1e9) if t > 0 else 0.0  # the busbw the time amounts to (nccl-tests' factor)
    calls, again = alltoall_calls(spec, setup, blocks)
    ops = [
        cm.CommOp(
            "EP all-to-all (dispatch, combine)",
            "all_to_all",
            scope,
            ep,
            size,
            calls * setup.grad_accum_steps,
            "ep",
            bw,
            t,
        )
    ]
    if again:
        name = "EP all-to-all (recompute)"
        ops.append(cm.CommOp(name, "all_to_all", scope, ep, size, again * setup.grad_accum_steps, "ep", bw, t))
    total = sum(o.time_per_step_s for o in ops)
    return cm.StepComm(ops, total, total, f"{ops[0].name} at {bw:.3g} GB/s")


def alltoall_seconds(comm_ops: list[cm.CommOp]) -> float:
    """The all-to-alls' seconds per step (all exposed; 0 without them)."""
    return sum(o.time_per_step_s for o in comm_ops if o.phase == "ep")


def expert_params_memo(spec: ModelSpec) -> int:
    """routed_expert_params of the whole model, cached per spec (the planner asks for every candidate)."""
    return fl._memo(spec, ("routed_expert_params",), lambda: routed_expert_params(spec))
