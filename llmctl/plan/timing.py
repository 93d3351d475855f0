"""Timing one setup: compute by kind of kernel (llmctl.plan.kernel_time: matmuls at their shape's rate, attention at
its kernel's measured rate, memory-bound ops and FSDP2's copies as bytes over bandwidth, the optimizer step), plus the
communication compute does not hide (llmctl.plan.comm); a candidate is a setup plus this prediction (torch-free).

Step time = accumulation x (forward + backward of one micro-batch) + optimizer step + exposed communication; the
prediction keeps the step split by kind (`Prediction.split`). Memory comes from llmctl.plan.memory only; this module
never re-derives a byte of the memory estimate.

Tensor parallelism (tp ranks share one micro-batch): each rank runs 1/tp of the split FLOPs (attention, dense MLPs,
LM head) and all of what the group replicates (MoE blocks: llmctl.plan.flops.tp_replicated_flops_per_token), at the
efficiency of its narrower matmuls (llmctl.plan.request.Efficiency.tp_width_factor); TP's collectives come from
llmctl.plan.comm.tp_calls, timed per layer kind with the matmul seconds async TP can hide them behind.

Context parallelism (cp ranks share one sequence): each rank runs its S/cp tokens of the matmuls and its share of the
sequence's attention (llmctl.spec.parallel.ParallelDims.attention_imbalance: the slowest rank sets the step); ring attention's K/V
and dK/dV exchanges come from llmctl.plan.ring, hidden behind the attention steps they run beside.

float8 (a policy with a float8 recipe, llmctl.spec.precision): the FLOPs of the linears torchao converts
(llmctl.plan.float8.converted) run at the GPU's fp8 peak, everything else (attention scores and values, the LM head,
routers, routed experts, linears not a multiple of 16) at the compute dtype's, both at the same achievable
efficiency; the dynamic casts add their bytes over the GPU's memory bandwidth (llmctl.plan.float8.cast_bytes), and
under the tensorwise recipe FSDP2 all-gathers the converted weights at 1 byte a parameter, with one all-reduce of
their amaxes a step. MFU stays against the compute dtype's (bf16) peak, torchtitan's convention for float8 runs: a
float8 run's MFU can then pass what its bf16 run reaches, which is the speed-up.

LoRA / QLoRA (`TrainSetup.finetune`): the method's FLOPs (llmctl.plan.flops.method_flops_per_token: the frozen base's
forward and input gradients, the adapters' forward and both gradients, attention unchanged) at the same achievable
efficiency (the adapters' thin rank-r matmuls are a small share and are not priced apart); FSDP all-gathers the
frozen layers as in full training and reduce-scatters only the adapters' gradients (`adapter_shape`); QLoRA adds the
NF4 dequantization's memory traffic (`qlora_dequant_s`). No optimizer step is timed for full training either.

CPU offload (`TrainSetup.levers.offload`): the copies between host and GPU, the host's gradient additions and its
optimizer step (llmctl.plan.offload) add `offload_s` to the step: step = compute + exposed communication + offload.

Pipeline parallelism (pp > 1, llmctl.plan.stages): the heaviest pp rank's share of each micro-batch's kernels, FSDP
and TP on its stages only, its optimizer step on its parameters, the schedule's bubble added to the compute
(`Prediction.bubble_s`, the step split's "bubble") and the sends between stages to the exposed communication
(`Prediction.p2p_comm_exposed_s`). At pp = 1 none of this runs: every figure is as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from llmctl.families.tensor_parallel import replicated as tp_replicated
from llmctl.plan import comm as cm
from llmctl.plan import experts as ex
from llmctl.plan import float8 as f8
from llmctl.plan import flops as fl
from llmctl.plan import kernel_time, ring
from llmctl.plan import memory as mem
from llmctl.plan import offload as ol
from llmctl.plan import stages as st
from llmctl.plan.memory import adapters as lora
from llmctl.plan.request import HBM_EFFICIENCY, PlanRequest
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.precision import DTYPE_BYTES
from llmctl.spec.setup import TrainSetup


@dataclass(frozen=True)
class Prediction:
    """What the planner's model predicts for one setup on the request's cluster."""

    efficiency: float
    """Fraction of the compute dtype's dense peak the model's matmuls reach for this micro-batch (shape efficiency,
    llmctl.plan.kernel_time.gemm_efficiency); attention and memory-bound work have their own rates."""
    compute_s: float
    """Compute seconds per optimizer step."""
    comm_total_s: float
    comm_exposed_s: float
    """Communication seconds per step that compute does not hide (data-parallel and tensor-parallel)."""
    step_time_s: float
    tokens_per_step: int
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    """Model FLOPs utilisation, causal attention counted half (llmctl.plan.flops.CAUSAL_MFU)."""
    memory_per_gpu_bytes: int
    """The memory model's device bytes per GPU (0: not sized, see `predict`)."""
    bottleneck: str
    mfu_palm: float = 0.0
    """The same with attention counted whole, as PaLM and torchtitan count it (llmctl.plan.flops.PALM_MFU): the figure
    published MFU is quoted in."""
    tp_comm_exposed_s: float = 0.0
    """Of comm_exposed_s, tensor parallelism's collectives."""
    cp_comm_exposed_s: float = 0.0
    """Of comm_exposed_s, context parallelism's ring attention exchanges."""
    bubble_s: float = 0.0
    """Of compute_s, the pipeline's idle time (llmctl.plan.stages.bubble); 0 without pipeline parallelism."""
    p2p_comm_exposed_s: float = 0.0
    """Of comm_exposed_s, the pipeline's point-to-point sends between stages (llmctl.plan.stages.p2p_comm)."""
    offload_s: float = 0.0
    """Seconds per step CPU offload adds (llmctl.plan.offload): copies not hidden, the host's work; 0 without it."""
    offload: ol.OffloadTime | None = field(default=None, compare=False, repr=False)
    comm_ops: list[cm.CommOp] = field(default_factory=list, compare=False, repr=False)
    budget_time_s: float | None = None
    budget_cost_usd: float | None = None
    split: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    """Seconds per optimizer step by kind (STEP_KINDS): the compute's kernels, then what compute does not hide."""


STEP_KINDS = {
    "matmul": "matmuls",
    "attention": "attention",
    "memory": "memory-bound ops",
    "framework": "FSDP copies and optimizer step",
    "comm": "exposed communication",
    "offload": "CPU offload",
    "bubble": "pipeline bubble",
}


@dataclass(frozen=True)
class Candidate:
    """A setup and its prediction."""

    setup: TrainSetup
    predicted: Prediction

    @property
    def label(self) -> str:
        s = self.setup
        tp = f" x TP {s.tp}{' (async)' if s.async_tp else ''}" if s.tp > 1 else ""
        cp = f" x CP {s.cp}" if s.cp > 1 else ""
        offload = " + CPU offload" if s.levers.offload else ""
        pp = f" x PP {s.pp} ({pipeline_label(s)})" if s.pp > 1 else ""
        ep = f" x EP {s.ep}" if s.ep > 1 else ""
        return f"{s.strategy.upper()} over {s.nodes} node{'s' if s.nodes > 1 else ''}{pp}{cp}{tp}{ep}{offload}"

    def as_dict(self) -> dict[str, Any]:
        s, p = self.setup, self.predicted
        return {
            "strategy": s.strategy,
            "nodes": s.nodes,
            "gpus": s.gpus,
            "tp": s.tp,
            "async_tp": s.async_tp,
            "cp": s.cp,
            "cp_rotate": s.cp_rotate,
            "cp_load_balance": s.cp_load_balance,
            "micro_batch": s.micro_batch_size,
            "grad_accum": s.grad_accum_steps,
            "checkpointing": s.checkpointing,
            "attention": s.attention,
            "compile": s.compile,
            "loss_chunk_tokens": s.loss_chunk_tokens,
            "tokens_per_s": p.tokens_per_s,
            "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
            "mfu": p.mfu,
            "mfu_palm": p.mfu_palm,
            "memory_per_gpu_bytes": p.memory_per_gpu_bytes,
            "step_time_s": p.step_time_s,
            "compute_s": p.compute_s,
            "comm_total_s": p.comm_total_s,
            "comm_exposed_s": p.comm_exposed_s,
            "tp_comm_exposed_s": p.tp_comm_exposed_s,
            "cp_comm_exposed_s": p.cp_comm_exposed_s,
            "efficiency": p.efficiency,
            "bottleneck": p.bottleneck,
            "budget_time_s": p.budget_time_s,
            "budget_cost_usd": p.budget_cost_usd,
            "step_split_s": dict(p.split),
            # Only under CPU offload, so that the answers without it stay as they were.
            **({"offload": True, "offload_s": p.offload_s} if s.levers.offload else {}),
            # Only under expert parallelism (ep 1 answers, every dense model's, stay as they were): the degree and
            # its all-to-alls' seconds per step (llmctl.plan.experts).
            **({"ep": s.ep, "ep_alltoall_s": ex.alltoall_seconds(p.comm_ops)} if s.ep > 1 else {}),
            # Only under pipeline parallelism, as the declarations write them (write_default=False): pp = 1 answers
            # stay as they were.
            **(
                {
                    "pp": s.pp,
                    "pp_schedule": str(s.pp_schedule),
                    "pp_microbatches": s.pipeline_microbatches,
                    "pp_virtual_stages": s.virtual_stages,
                    "bubble_s": p.bubble_s,
                    "p2p_comm_exposed_s": p.p2p_comm_exposed_s,
                }
                if s.pp > 1
                else {}
            ),
        }


def pipeline_label(s: TrainSetup) -> str:
    """'interleaved-1f1b, v 2, 64 micro-batches a run' (a setup with pp > 1)."""
    v = f", v {s.virtual_stages}" if s.pp_schedule == "interleaved-1f1b" else ""
    return f"{s.pp_schedule}{v}, {s.pipeline_microbatches} micro-batches a run"


def recompute_memory_s(req: PlanRequest, setup: TrainSetup) -> float:
    """Seconds per micro-batch of the memory-bound ops selective checkpointing regenerates: each tensor a block
    would keep without checkpointing and selective does not keep is written again after its input is read (2x its
    bytes through device memory, at HBM_EFFICIENCY of the catalog bandwidth). Whole-block recompute (full, partial)
    re-runs the same mix of ops as the forward, which the FLOP-based efficiency already prices."""
    if setup.checkpointing != "selective" or req.gpu.hbm_gbytes_s <= 0:
        return 0.0
    # One rank's share under tensor parallelism (llmctl's engine: torch's sequence-parallel layout, as the memory
    # model; the zero ledger keeps Megatron's everything-divides-by-tp).
    per_rank = setup.engine == "fsdp2" and req.spec.measured is None
    regenerated = mem.recompute_buffer_bytes(
        req.spec,
        setup.micro_batch_size,
        req.seq_len // setup.cp,  # this rank's tokens under context parallelism
        setup.compute_bytes,
        setup.attention,
        setup.checkpointing,
        tp=setup.tp if per_rank else 1,
    )
    share = 1 if per_rank else setup.tp
    return 2 * regenerated * req.spec.num_layers / share / (req.gpu.hbm_gbytes_s * 1e9 * HBM_EFFICIENCY)


def float8_saving(req: PlanRequest, setup: TrainSetup) -> float:
    """The fraction of a converted linear's time at the compute dtype's peak that float8 takes off: 1 - peak(compute)
    / peak(fp8) (0.5 on Hopper, Ada and MI300X: twice the dense rate); 0 without float8."""
    p = setup.precision
    if not p.float8:
        return 0.0
    return 1 - req.gpu.peak_tflops(p.compute_dtype) / req.gpu.peak_tflops(p.linear_dtype)


def _recompute_per_rank(
    req: PlanRequest,
    ckpt: str,
    attention: str,
    chunked: bool,
    tp: int,
    imbalance: float = 1.0,
    saving: float = 0.0,
) -> float:
    """Recompute FLOPs per token one rank of a tp group runs (all of them at tp = 1), with the float8 linears' counted
    at the compute dtype's rate (`saving` of them taken off, float8_saving); `imbalance` scales the attention share
    (the slowest cp rank's, ParallelDims.attention_imbalance)."""
    again = fl.recompute_flops_per_token(req.spec, req.seq_len, ckpt, attention, chunked)
    if imbalance != 1.0:
        again += (imbalance - 1) * fl.recompute_attention_flops_per_token(req.spec, req.seq_len, ckpt, attention)
    if saving:
        again -= saving * f8.recompute_linear_flops_per_token(req.spec, ckpt)[0]
    if tp == 1:
        return again
    rep = fl.tp_replicated_flops_per_token(req.spec, req.seq_len, ckpt, attention)[1]
    if saving:
        rep -= saving * f8.recompute_linear_flops_per_token(req.spec, ckpt)[1]
    return (again - rep) / tp + rep


@dataclass(frozen=True)
class ComputeSplit:
    """One micro-batch on one rank (the slowest of a cp group), seconds by kind of kernel (llmctl.plan.kernel_time);
    forward + backward of these is the micro-batch's compute."""

    matmul_fwd_s: float
    matmul_bwd_s: float
    """The matmuls' backward, with what checkpointing re-runs of them."""
    attention_fwd_s: float
    attention_bwd_s: float
    """Attention's backward, with what checkpointing re-runs of its forward."""
    memory_fwd_s: float
    memory_bwd_s: float
    """Memory-bound ops (norms, activations, rotary, the loss, adapters; selective checkpointing's regenerated
    tensors, float8's casts, QLoRA's dequantization), with the recomputed blocks' forward ones in backward."""
    framework_s: float
    """FSDP2's copies around its collectives (counted in backward)."""

    @property
    def fwd_s(self) -> float:
        return self.matmul_fwd_s + self.attention_fwd_s + self.memory_fwd_s

    @property
    def bwd_s(self) -> float:
        return self.matmul_bwd_s + self.attention_bwd_s + self.memory_bwd_s + self.framework_s


def compute_split(req: PlanRequest, setup: TrainSetup) -> tuple[float, ComputeSplit]:
    """(matmul efficiency, split) of one micro-batch on one GPU. The matmul FLOPs (the model's and the recomputed,
    after float8, tensor-parallel and LoRA adjustments) run at the GPU's peak x the matmuls' shape efficiency
    (kernel_time.gemm_efficiency); attention's scores and values at the kernel table's rate for its head dimension
    and length (kernel_time.attention_seconds); the rest is bytes over bandwidth. Under context parallelism a rank
    runs its S/cp tokens of each sequence through the matmuls and its share of the sequence's attention
    (ParallelDims.attention_imbalance)."""
    mb, ckpt, attention, chunked, tp = (
        setup.micro_batch_size,
        setup.checkpointing,
        setup.attention,
        setup.loss_chunk_tokens > 0,
        setup.tp,
    )
    spec, gpu = req.spec, req.gpu
    tokens = mb * req.seq_len // setup.cp  # this rank's tokens per micro-batch (the rows of its GEMMs)
    eff = req.efficiency.of(tokens, spec, gpu, req.compute_dtype, tp=tp, ep=setup.ep)
    rate = gpu.peak_tflops(req.compute_dtype) * 1e12 * eff
    # float8: every FLOP below is priced at the compute dtype's rate, the converted linears' with `saving` of their
    # time taken off (their FLOPs at the fp8 peak); a float8 FLOP splits forward/backward 1:2 as the others do.
    saving = float8_saving(req, setup)
    model = fl.model_flops_per_token(spec, req.seq_len)
    linear, linear_rep = f8.linear_flops_per_token(spec) if saving else (0, 0)
    model -= saving * linear
    imbalance = setup.dims.attention_imbalance(setup.cp_load_balance)
    if imbalance != 1.0:
        model += (imbalance - 1) * fl.attention_flops_per_token(spec, req.seq_len)
    if setup.ep > 1 and ex.IMBALANCE != 1.0:  # the busiest ep rank's experts (llmctl.plan.experts)
        model += (ex.IMBALANCE - 1) * ex.expert_flops_per_token(spec)
    if tp > 1:  # each rank: 1/tp of what the group splits, all of what it replicates
        rep = fl.tp_replicated_flops_per_token(spec, req.seq_len)[0] - saving * linear_rep
        model = (model - rep) / tp + rep
    again = _recompute_per_rank(req, ckpt, attention, chunked, tp, imbalance, saving)
    # Attention's FLOPs leave the matmul count: the kernel table times them.
    model -= fl.attention_flops_per_token(spec, req.seq_len) * imbalance / tp
    again -= fl.recompute_attention_flops_per_token(spec, req.seq_len, ckpt, attention) * imbalance / tp
    # forward 2N of 6N (Kaplan et al. 2020), backward the rest
    model_fwd, model_bwd = model / 3, model * 2 / 3
    ft = setup.finetune
    if ft.adapters:  # tp = 1, no float8 (TrainSetup refuses them with adapters): the method's own split
        fwd_ft, bwd_ft = fl.method_flops_per_token(spec, req.seq_len, ft)
        full_fwd, full_bwd = fl.method_flops_per_token(spec, req.seq_len)
        model_fwd, model_bwd = model_fwd + fwd_ft - full_fwd, model_bwd + bwd_ft - full_bwd
        again += fl.adapter_recompute_flops_per_token(spec, ckpt, ft)
    attn_fwd, attn_bwd, attn_again = kernel_time.attention_seconds(
        gpu, spec, setup, req.seq_len, req.compute_dtype, imbalance
    )
    cal = req.efficiency.calibration
    k = cal * gpu.efficiency  # the catalog's discount on the kernel tables' rates, and --calibrate
    attn_fwd, attn_bwd, attn_again = attn_fwd / k, attn_bwd / k, attn_again / k
    mem = kernel_time.memory_time(gpu, spec, setup, tokens, cal)
    mm_fwd = tokens * model_fwd / rate
    redo = tokens * again / rate + attn_again + mem.recompute_s
    if ckpt == "selective":
        # Selective re-runs a subset of what full re-runs: never more time than full's recompute (a GPU with little
        # memory bandwidth for its FLOPs, e.g. L40S with eager attention, would otherwise price it above).
        full_attn = kernel_time.attention_seconds(gpu, spec, setup, req.seq_len, req.compute_dtype, imbalance, "full")
        full_attn = full_attn[2] / k
        full_again = _recompute_per_rank(req, "full", attention, chunked, tp, imbalance, saving)
        full_again -= fl.recompute_attention_flops_per_token(spec, req.seq_len, "full", attention) * imbalance / tp
        full_mem = kernel_time.memory_time(gpu, spec, setup, tokens, cal, "full").recompute_s
        redo = min(redo + recompute_memory_s(req, setup) / cal, tokens * full_again / rate + full_attn + full_mem)
    mm_bwd = tokens * model_bwd / rate
    mem_fwd, mem_bwd = mem.fwd_s, mem.bwd_s
    if ft.method == "qlora":
        deq_fwd, deq_bwd = (t / cal for t in qlora_dequant_s(req, setup))
        mem_fwd, mem_bwd = mem_fwd + deq_fwd, mem_bwd + deq_bwd
    if saving:
        cast_fwd, cast_bwd = (t / cal for t in float8_cast_s(req, setup, tokens))
        mem_fwd, mem_bwd = mem_fwd + cast_fwd, mem_bwd + cast_bwd
    # What checkpointing re-runs is counted with the kind it re-runs, in backward: its matmuls, its attention, its
    # memory-bound ops (redo holds all three; split by their shares for the step split).
    regen = recompute_memory_s(req, setup) / cal  # selective's regenerated tensors (0 otherwise)
    r_mm, r_attn, r_mem = _share(redo, tokens * again / rate, attn_again, mem.recompute_s + regen)
    return eff, ComputeSplit(
        matmul_fwd_s=mm_fwd,
        matmul_bwd_s=mm_bwd + r_mm,
        attention_fwd_s=attn_fwd,
        attention_bwd_s=attn_bwd + r_attn,
        memory_fwd_s=mem_fwd,
        memory_bwd_s=mem_bwd + r_mem,
        framework_s=mem.framework_s,
    )


def _share(total: float, *parts: float) -> tuple[float, ...]:
    """`total` split in proportion to `parts` (all to the last when they sum to 0)."""
    s = sum(parts)
    if s <= 0:
        return (*(0.0 for _ in parts[:-1]), total)
    return tuple(total * p / s for p in parts)


def compute_times(req: PlanRequest, setup: TrainSetup) -> tuple[float, float, float]:
    """(matmul efficiency, forward s, backward s) of one micro-batch on one GPU (compute_split)."""
    eff, split = compute_split(req, setup)
    return eff, split.fwd_s, split.bwd_s


def qlora_dequant_s(req: PlanRequest, setup: TrainSetup) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's NF4 dequantization on one rank: each block linear's weight read
    in NF4 (about 0.5 byte) and written in the compute dtype, once in forward, once in backward and once more in a
    recomputed block (torchao's linear_nf4 dequantizes per call, as bitsandbytes does; memory-bound, over the catalog's bandwidth at HBM_EFFICIENCY
    as the other memory-bound kernels). FSDP's shards are dequantized whole on each rank: the bytes do not divide."""
    if req.gpu.hbm_gbytes_s <= 0:
        return 0.0, 0.0
    per_weight = lora.NF4_BYTES_PER_WEIGHT + setup.compute_bytes
    q = fl._memo(req.spec, ("quantized_params",), lambda: lora.quantized_params(req.spec))
    if setup.checkpointing == "selective":
        again = q
    else:
        again = q * len(ckpt_modes.whole_layers(setup.checkpointing, req.spec.num_layers)) / req.spec.num_layers
    bw = req.gpu.hbm_gbytes_s * 1e9 * HBM_EFFICIENCY
    return q * per_weight / bw, (q + again) * per_weight / bw


def float8_cast_s(req: PlanRequest, setup: TrainSetup, tokens: int) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch's dynamic float8 casts on one rank: their bytes
    (llmctl.plan.float8.cast_bytes) over the catalog's memory bandwidth at HBM_EFFICIENCY, as the other
    memory-bound kernels."""
    fwd_b, bwd_b = f8.cast_bytes(
        req.spec,
        setup.precision,
        tokens,
        setup.checkpointing,
        setup.compile,
        setup.tp,
        setup.dims.fsdp_shard,
        setup.grad_accum_steps,
    )
    bw = req.gpu.hbm_gbytes_s * 1e9 * HBM_EFFICIENCY
    return fwd_b / bw, bwd_b / bw


def tp_replicated_params(spec: ModelSpec) -> int:
    """Parameters every rank of a tp group holds whole: the norms (and per-head q/k norms), MLA's latent projections
    and the MoE blocks
    (llmctl.families.tensor_parallel); the rest is split over the tp ranks."""
    h = spec.hidden_size
    total = h  # the final norm
    for layer, n in spec.layer_groups:
        total += n * sum(
            math.prod(shape)
            for name, shape in layer.tensors(h)
            if tp_replicated(name) or (layer.mlp.moe and name.startswith("mlp."))
        )
    return total


def tp_layers(
    req: PlanRequest, setup: TrainSetup, rate: float, blocks: tuple[int, ...] | None = None
) -> tuple[list[cm.TpLayer], float]:
    """The layer kinds TP's collectives are counted over (llmctl.plan.comm.tp_calls) and the LM head's forward matmul
    seconds: per kind, the forward seconds of one micro-batch's matmuls on one rank that each collective pairs with
    (a float8 linear's at the fp8 peak). `blocks`: a pp rank's blocks (None: all)."""
    spec, tp, tokens = req.spec, setup.tp, setup.micro_batch_size * req.seq_len // setup.cp
    h = spec.hidden_size
    saving = float8_saving(req, setup)

    def secs(mms: list[tuple[str, int, int]], fast: list[bool] | None = None) -> float:
        fast = fast or [False] * len(mms)
        return tokens * sum(2 * i * o * (1 - saving * f) for (_, i, o), f in zip(mms, fast)) / tp / rate

    groups = spec.groups_of(blocks)  # a pipeline rank's blocks only, or all
    recomputed: dict[Layer, int] = {}
    if setup.checkpointing == "selective":
        recomputed = {layer: n for layer, n in groups}
    else:
        for i in ckpt_modes.whole_layers(setup.checkpointing, spec.num_layers):
            if blocks is None or i in blocks:
                recomputed[spec.layers[i]] = recomputed.get(spec.layers[i], 0) + 1
    out = []
    for layer, n in groups:
        attn, mlp = layer.attention.matmuls(h), layer.mlp.matmuls(h)
        dense = not layer.mlp.moe
        # f8.converted follows layer_matmuls, which is attention's then the MLP's (all False for GPT-2's Conv1D)
        fast = f8.converted(spec, layer) if saving else [False] * (len(attn) + len(mlp))
        a = len(attn)
        out.append(
            cm.TpLayer(
                count=n,
                recomputed=recomputed.get(layer, 0),
                dense_mlp=dense,
                norm_after_mlp=any(name.startswith("post_feedforward") for name in layer.norms),
                qkv_s=secs(attn[:-1], fast[: a - 1]),
                o_s=secs(attn[-1:], fast[a - 1 : a]),
                gate_up_s=secs(mlp[:-1], fast[a:-1]) if dense else 0.0,
                down_s=secs(mlp[-1:], fast[-1:]) if dense else 0.0,
            )
        )
    return out, secs([("lm_head", h, spec.vocab_size)])


def tp_comm(req: PlanRequest, setup: TrainSetup, efficiency: float, share: st.RankShare = st.WHOLE) -> cm.StepComm:
    """Tensor parallelism's collectives per optimizer step (none at tp = 1); `share`: the pp rank's stages."""
    if setup.tp == 1:
        return cm.StepComm(ops=[], total_s=0.0, exposed_s=0.0, bottleneck="")
    rate = req.gpu.peak_tflops(req.compute_dtype) * 1e12 * efficiency
    layers, head_s = tp_layers(req, setup, rate, share.blocks if setup.pp > 1 else None)
    # The activation a TP collective moves: this rank's tokens (S/cp of each sequence under context parallelism).
    activation = setup.micro_batch_size * req.seq_len // setup.cp * req.spec.hidden_size * setup.compute_bytes
    return cm.tp_step_comm(
        cm.tp_calls(layers, head_s, share.embedding, share.head),
        setup.tp,
        activation,
        setup.grad_accum_steps,
        req.network,
        setup.gpus_per_node,
        setup.async_tp,
    )


def cp_comm(req: PlanRequest, setup: TrainSetup, efficiency: float, share: st.RankShare = st.WHOLE) -> cm.StepComm:
    """Context parallelism's ring attention exchanges per optimizer step (llmctl.plan.ring; none at cp = 1);
    `share`: the pp rank's stages."""
    if setup.cp == 1:
        return cm.StepComm(ops=[], total_s=0.0, exposed_s=0.0, bottleneck="")
    rate = req.gpu.peak_tflops(req.compute_dtype) * 1e12 * efficiency
    layers = ring.ring_layers(req.spec, setup, rate, share.blocks if setup.pp > 1 else None)
    return ring.ring_step_comm(layers, setup, req.network, setup.gpus_per_node)


def float8_gather(spec: ModelSpec, setup: TrainSetup, shape: cm.CommShape, share: float = 1.0) -> cm.CommShape:
    """The FSDP shape under the float8 all-gather (tensorwise, llmctl.plan.float8): the converted weights gathered at
    1 byte a parameter (the average over what a rank gathers), and their amaxes all-reduced once a step. As it is
    otherwise. `share`: a pp rank's fraction of the parameters (the average holds for its stages)."""
    if not (setup.precision.float8_all_gather and setup.dims.fsdp_shard > 1):
        return shape
    converted = f8.params_per_rank(*f8.linear_params(spec), setup.tp)
    held = shape.params_per_rank
    gathered = (held - converted) * shape.param_bytes + converted * DTYPE_BYTES[setup.precision.linear_dtype]
    return replace(shape, param_bytes=gathered / held, float8_amaxes=round(f8.linear_count(spec) * share))


def adapter_shape(spec: ModelSpec, setup: TrainSetup, shape: cm.CommShape) -> cm.CommShape:
    """The FSDP shape with adapters: the frozen layer and its adapters all-gathered as in full training (in the compute
    dtype; the NF4 linears at their stored bytes under QLoRA), only the adapters' gradients reduced."""
    ft = setup.finetune
    if not ft.adapters:
        return shape
    n = fl.adapter_count(spec, ft)
    base = fl._memo(
        spec,
        ("base_bytes", ft.method, setup.compute_bytes, setup.dims.fsdp_shard),
        lambda: lora.base_bytes_per_param(spec, setup),
    )
    gathered = (base * spec.params + n * setup.compute_bytes) / (spec.params + n)
    return replace(shape, params=spec.params + n, param_bytes=gathered, grad_params=n)


def stage_split(parts: ComputeSplit, share: st.RankShare) -> ComputeSplit:
    """One micro-batch's compute on a pp rank: the model's split (compute_split) at the rank's shares, matmuls and
    memory-bound ops by its matmul FLOPs (the LM head's with the loss on the last stage), attention by its blocks'
    attention FLOPs, FSDP's copies by its parameters."""
    return ComputeSplit(
        matmul_fwd_s=parts.matmul_fwd_s * share.matmul,
        matmul_bwd_s=parts.matmul_bwd_s * share.matmul,
        attention_fwd_s=parts.attention_fwd_s * share.attention,
        attention_bwd_s=parts.attention_bwd_s * share.attention,
        memory_fwd_s=parts.memory_fwd_s * share.matmul,
        memory_bwd_s=parts.memory_bwd_s * share.matmul,
        framework_s=parts.framework_s * share.params,
    )


def expert_shape(spec: ModelSpec, setup: TrainSetup) -> dict[str, int]:
    """The routed experts' part of FSDP's shape under expert parallelism (llmctl.plan.experts; none at ep 1, whose
    experts FSDP moves with the rest)."""
    if setup.ep <= 1:
        return {}
    return {"expert_params": ex.expert_params_memo(spec), "moe_layers": ex.moe_layer_count(spec)}


def stage_shape(shape: cm.CommShape, share: st.RankShare) -> cm.CommShape:
    """FSDP's shape on a pp rank: its stages' parameters over its blocks (llmctl.plan.stages.RankShare)."""
    return replace(
        shape,
        params=round(shape.params * share.params),
        num_layers=share.layers,
        tp_replicated_params=round(shape.tp_replicated_params * share.params),
        expert_params=round(shape.expert_params * share.params),
        moe_layers=shape.moe_layers and max(1, round(shape.moe_layers * share.layers / shape.num_layers)),
    )


def evaluate(req: PlanRequest, setup: TrainSetup, memory_bytes: int = 0) -> Candidate:
    """Predict one setup (no fit check: the caller decides what fits). Under pipeline parallelism the heaviest pp
    rank's stages set the pace (llmctl.plan.stages): its compute, its FSDP and TP collectives, the sends between
    stages and the schedule's bubble."""
    g = setup.gpus_per_node
    eff, parts = compute_split(req, setup)
    piped = setup.pp > 1
    share = st.heaviest_rank(req.spec, setup) if piped else st.WHOLE
    if piped:
        parts = stage_split(parts, share)
    fwd, bwd = parts.fwd_s, parts.bwd_s
    # The engine all-gathers parameters in the compute dtype and reduces gradients in the reduce dtype.
    shape = cm.CommShape(
        params=req.spec.params,
        num_layers=req.spec.num_layers,
        param_bytes=setup.precision.compute_bytes,
        grad_bytes=setup.precision.reduce_bytes,
        tp=setup.tp,
        tp_replicated_params=tp_replicated_params(req.spec) if setup.tp > 1 else 0,
        **expert_shape(req.spec, setup),
    )
    shape = adapter_shape(req.spec, setup, shape)
    shape = float8_gather(req.spec, setup, shape, share.params)
    accum = setup.grad_accum_steps
    if piped:
        shape = stage_shape(shape, share)
        runs = accum // setup.pipeline_microbatches
        c = cm.step_comm(setup.dims, shape, g, runs, fwd, bwd, req.network, req.overlap, pipelined=True)
    else:
        c = cm.step_comm(setup.dims, shape, g, accum, fwd, bwd, req.network, req.overlap, req.sync_every_micro_batch)
    off = ol.offload_time(req.gpu, req.spec, setup, fwd, bwd, c.ops, req.overlap) if setup.levers.offload else None
    t = tp_comm(req, setup, eff, share)
    c = cm.combine(c, t)
    r = cp_comm(req, setup, eff, share)
    c = cm.combine(c, r)
    p2p = st.p2p_comm(setup, req.spec.hidden_size, req.network, req.overlap)
    c = cm.combine(c, p2p)
    a2a = ex.ep_comm(req.spec, setup, req.seq_len, req.network, share.blocks if piped else None)
    c = cm.combine(c, a2a)
    optimizer_s = kernel_time.optimizer_seconds(req.gpu, req.spec, setup) / req.efficiency.calibration
    bubble_s = 0.0
    if piped:
        optimizer_s *= share.params
        # The weight gradients (ZB-V's W) cost the forward matmuls: 2 FLOPs a weight a token each.
        frac = st.bubble(
            setup.pp_schedule, setup.pp, setup.pipeline_microbatches, setup.virtual_stages, fwd, bwd, parts.matmul_fwd_s
        )
        bubble_s = accum * (fwd + bwd) * frac
    compute = accum * (fwd + bwd) + optimizer_s
    if piped:
        compute += bubble_s
    offload_s = off.exposed_s if off is not None else 0.0
    split = {
        "matmul": accum * (parts.matmul_fwd_s + parts.matmul_bwd_s),
        "attention": accum * (parts.attention_fwd_s + parts.attention_bwd_s),
        "memory": accum * (parts.memory_fwd_s + parts.memory_bwd_s),
        "framework": accum * parts.framework_s + optimizer_s,
        "comm": c.exposed_s,
        "offload": offload_s,
    }
    if piped:
        split["bubble"] = bubble_s
    step = compute + c.exposed_s + offload_s
    gpus = setup.gpus
    tokens_step = setup.tokens_per_step
    tps = tokens_step / step
    per_gpu = tps / gpus
    peak = req.gpu.peak_tflops(req.compute_dtype)
    mfu = fl.mfu(req.spec, req.seq_len, per_gpu, peak, setup.finetune)
    mfu_palm = fl.mfu(req.spec, req.seq_len, per_gpu, peak, setup.finetune, causal=False)
    budget_t = req.token_budget / tps if req.token_budget else None
    cost = (
        budget_t / 3600 * gpus * req.price_per_gpu_hour
        if budget_t is not None and req.price_per_gpu_hour is not None
        else None
    )
    predicted = Prediction(
        efficiency=eff,
        compute_s=compute,
        comm_total_s=c.total_s,
        comm_exposed_s=c.exposed_s,
        step_time_s=step,
        tokens_per_step=tokens_step,
        tokens_per_s=tps,
        tokens_per_s_per_gpu=per_gpu,
        mfu=mfu,
        mfu_palm=mfu_palm,
        memory_per_gpu_bytes=memory_bytes,
        bottleneck=c.bottleneck,
        tp_comm_exposed_s=t.exposed_s,
        cp_comm_exposed_s=r.exposed_s,
        bubble_s=bubble_s,
        p2p_comm_exposed_s=p2p.exposed_s,
        offload_s=offload_s,
        offload=off,
        comm_ops=c.ops,
        budget_time_s=budget_t,
        budget_cost_usd=cost,
        split=split,
    )
    return Candidate(setup, predicted)


def predict(req: PlanRequest, setup: TrainSetup) -> Candidate:
    """One setup timed (`evaluate`) and sized (the memory model, bytes per GPU), whether or not it fits: what
    `llmctl tune` records next to each trial's measurement."""
    return evaluate(req, setup, memory_bytes=mem.estimate(req.spec, setup).device_bytes)
