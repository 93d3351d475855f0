"""float8 training, derived from the model's shapes (torch-free): which linear layers torchao converts, the FLOPs they
run on float8 tensor cores, the bytes dynamic scaling moves through device memory, the parameters FSDP2 all-gathers
in float8 and the transient float8 copies. The cost model (llmctl.plan.timing) and the memory model
(llmctl.plan.memory.estimate) read it under a float8 precision policy (llmctl.spec.precision: fp8-tensorwise,
fp8-rowwise); nothing here is fitted to a published run.

Which linears convert (`converted`): torchao's convert_to_float8_training swaps `nn.Linear` modules only
(torchao/float8/float8_linear_utils.py swap_linear_layers), through torchtitan's filter
(torchtitan/components/quantization/utils.py module_filter_fn, filter_fqns=["output", "router.gate"] in its float8
docs): in and out features multiples of 16 (torch._scaled_mm's requirement), not the LM head, not the MoE router.
Left in the compute dtype too: the routed experts (3-D parameters in transformers >= 5, not nn.Linear: torchao's
grouped-GEMM float8 is another converter), GPT-2's Conv1D projections (not nn.Linear), the attention's score and value
matmuls (not linears), and a model measured on fake tensors (no module layout to filter: priced as not converted).

Dynamic scaling (torchao/float8/float8_linear.py matmul_with_hp_or_float8_args, float8_scaling_utils
hp_tensor_to_float8_dynamic): every matmul operand is cast on the fly, amax then scale-and-cast. Per converted linear
and micro-batch: forward casts its input and its weight; backward casts grad_output twice (for grad_input and for
grad_weight), the weight and the input again (from the high-precision input it saved). Each cast reads the tensor to
take its amax, reads it again and writes one byte an element: 2 x compute bytes + 1 (5 for bf16), memory-bound;
under torch.compile the amax fuses into the kernel that produced the tensor (torchtitan float8.md: compile "fuses
the float8 scaling/casting kernels"), leaving one read and the write (3 for bf16).

Tensorwise all-gather (torchao enable_fsdp_float8_all_gather, fsdp_utils.WeightWithDynamicFloat8CastTensor): FSDP2
casts each converted weight's fp32 shard to float8 before the all-gather (reads 4, writes 1 an element, each gather)
with the scale precomputed once a step (precompute_float8_dynamic_scale_for_fsdp: one read of the shards and one
all-reduce of the amaxes over the shard group); the gather moves 1 byte a parameter and the unsharded weight is
float8, so the linear casts no weight itself.

Tensor parallelism (llmctl.engine.tensor_parallel): under tensorwise scaling torchao's Float8ColwiseParallel /
Float8RowwiseParallel (float8_tensor_parallel.py) cast each operand on this rank's shard (a column-wise input before
its all-gather, a row-wise output's gradient before the backward all-gather), so a rank casts 1/tp of what the split
linears cast (an upper bound: q, k and v, or gate and up, share one input cast there). Rowwise-scaled layers keep
torch's styles: a column-wise linear casts its input after TP's bf16 all-gather, the whole sequence on every rank,
and a row-wise one its output's gradient after the backward all-gather, whole too (`_shares`). The MoE blocks a tp
group replicates (llmctl.families.tensor_parallel) are cast whole.
"""

from __future__ import annotations

import math

from llmctl.plan.flops import _memo, layer_matmuls, model_flops_per_token, selective_kept
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.layers import Layer
from llmctl.spec.models import ModelSpec
from llmctl.spec.precision import PrecisionPolicy, float8_convertible

MEASURED_H100 = (
    # (model and setup, measured float8 / bf16 tokens/s, this model's predicted ratio for the same setups)
    ("Llama-3.2-1B at micro-batch 8 x 2,048 tokens", 57_916 / 56_120, 56_930 / 51_975),
    ("Llama-3.2-3B at micro-batch 2 x 2,048 tokens", 15_934 / 17_766, 18_016 / 16_453),
)
"""float8 (tensorwise, torch.compile) against bf16-mixed on one H100, measured by the GPU tier (tests/gpu) with
torch 2.11 and torchao 0.18: docs/measurements/h100-gpu-tier.json, speed/*; tests/plan/test_measured_h100.py ties
the predicted ratios to the planner as it is. At these widths (2,048 and 3,072) the casts and their kernels cost
about what the float8 matmuls save; the planner, pricing the rest of the step by kind of kernel, now predicts a
gain of 1.10x for both (it predicted 1.32x and 1.38x with one efficiency for every kernel), still above what ran."""

NOT_LINEAR = ("router", "expert gate_up", "expert down")
"""llmctl.spec.layers.Mlp.matmuls names that are not converted: the router (filtered by name, as the engine's
llmctl.engine.float8 ROUTER_NAMES), the routed experts (3-D parameters, not nn.Linear)."""
AMAX_BYTES = 4
"""One fp32 amax (and scale) per tensor under tensorwise scaling, per row under rowwise."""


def converted(spec: ModelSpec, layer: Layer | None = None) -> list[bool]:
    """Per llmctl.plan.flops.layer_matmuls entry of a block: whether torchao converts that linear (module
    docstring)."""
    layer = layer or spec.layers[0]
    return list(_memo(spec, ("float8_converted", layer), lambda: _converted(spec, layer)))


def _converted(spec: ModelSpec, layer: Layer) -> tuple[bool, ...]:
    mms = layer_matmuls(spec, layer)
    if spec.measured is not None or spec.features.conv1d:  # torchao converts nn.Linear, not Conv1D
        return (False,) * len(mms)
    # The shape rule is the engine's filter's (llmctl.engine.float8.convert asks the same function).
    return tuple(name not in NOT_LINEAR and float8_convertible(i, o) for name, i, o in mms)


def _replicated(spec: ModelSpec, layer: Layer) -> list[bool]:
    """Per layer_matmuls entry: whether it sits in an MoE block, which a tp group runs whole on every rank."""
    first = len(layer.attention.matmuls(spec.hidden_size)) if spec.measured is None else 0
    return [layer.mlp.moe and spec.measured is None and k >= first for k in range(len(layer_matmuls(spec, layer)))]


def _recomputed(spec: ModelSpec, checkpointing: str) -> list[tuple[Layer, int, list[bool]]]:
    """(block kind, how many of it backward re-runs, which of its matmuls): whole blocks under full and partial, the
    matmuls selective does not keep in every block (llmctl.plan.flops.selective_kept). Cached per spec."""
    return _memo(spec, ("float8_recomputed", checkpointing), lambda: _recomputed_blocks(spec, checkpointing))


def _recomputed_blocks(spec: ModelSpec, checkpointing: str) -> list[tuple[Layer, int, list[bool]]]:
    if checkpointing == "none":
        return []
    if checkpointing == "selective":
        return [(layer, n, [not k for k in selective_kept(spec, layer)]) for layer, n in spec.layer_groups]
    counts: dict[Layer, int] = {}
    for i in ckpt_modes.whole_layers(checkpointing, spec.num_layers):
        counts[spec.layers[i]] = counts.get(spec.layers[i], 0) + 1
    return [(layer, n, [True] * len(layer_matmuls(spec, layer))) for layer, n in counts.items()]


def _fwd_flops(spec: ModelSpec, layer: Layer, pick: list[bool]) -> int:
    """Forward FLOPs per token of a block's converted linears among `pick`."""
    mms = layer_matmuls(spec, layer)
    return sum(2 * i * o for (_, i, o), c, p in zip(mms, converted(spec, layer), pick) if c and p)


def linear_flops_per_token(spec: ModelSpec) -> tuple[int, int]:
    """(all, tp-replicated) model FLOPs per token on float8 tensor cores: forward + backward (3 x the forward, as
    6N is 3 x 2N) of the converted linears; the second is the part inside MoE blocks (llmctl.plan.flops
    .tp_replicated_flops_per_token's share)."""
    return _memo(spec, ("float8_linear",), lambda: _linear_flops(spec))


def _linear_flops(spec: ModelSpec) -> tuple[int, int]:
    total = sum(n * 3 * _fwd_flops(spec, la, [True] * len(converted(spec, la))) for la, n in spec.layer_groups)
    rep = sum(n * 3 * _fwd_flops(spec, la, _replicated(spec, la)) for la, n in spec.layer_groups)
    return total, rep


def recompute_linear_flops_per_token(spec: ModelSpec, checkpointing: str) -> tuple[int, int]:
    """(all, tp-replicated) FLOPs per token of the converted linears' forward that checkpointing re-runs (the LM head,
    which the chunked loss re-runs, is never converted)."""
    return _memo(spec, ("float8_recompute", checkpointing), lambda: _recompute_flops(spec, checkpointing))


def _recompute_flops(spec: ModelSpec, checkpointing: str) -> tuple[int, int]:
    total = rep = 0
    for layer, n, mask in _recomputed(spec, checkpointing):
        total += n * _fwd_flops(spec, layer, mask)
        rep += n * _fwd_flops(spec, layer, [m and r for m, r in zip(mask, _replicated(spec, layer))])
    return total, rep


def linear_params(spec: ModelSpec) -> tuple[int, int]:
    """(all, tp-replicated) parameters of the converted linears' weights (biases stay in the compute dtype)."""
    return _memo(spec, ("float8_params",), lambda: _linear_params(spec))


def _linear_params(spec: ModelSpec) -> tuple[int, int]:
    total = rep = 0
    for layer, n in spec.layer_groups:
        for (_, i, o), c, r in zip(layer_matmuls(spec, layer), converted(spec, layer), _replicated(spec, layer)):
            total += n * i * o * c
            rep += n * i * o * (c and r)
    return total, rep


def linear_count(spec: ModelSpec) -> int:
    """Converted linear modules: the amaxes one precompute all-reduces."""
    return sum(n * sum(converted(spec, layer)) for layer, n in spec.layer_groups)


ROW_SPLIT = ("o_proj", "down_proj", "shared down_proj")
"""The matmuls a tensor-parallel plan splits by rows (input features: RowwiseParallel); the others it splits are
column-wise (llmctl.families.tensor_parallel)."""


def _shares(policy: PrecisionPolicy, name: str, replicated: bool, tp: int) -> tuple[int, int, int]:
    """(input, weight, grad_output) divisors: how many tp ranks share one linear's cast of each (module docstring).
    Under rowwise scaling torch's styles hand a column-wise linear the all-gathered input and a row-wise one the
    all-gathered gradient of its output: those casts are whole on every rank."""
    if replicated or tp <= 1:
        return 1, 1, 1
    if not policy.float8_row_scales:
        return tp, tp, tp
    row = name in ROW_SPLIT
    return (tp if row else 1), tp, (1 if row else tp)


def params_per_rank(total: int, replicated: int, tp: int) -> float:
    """What one rank of a tp group holds (or casts) of a quantity whose `replicated` part a tp group does not split."""
    return (total - replicated) / tp + replicated


def cast_element_bytes(compute_bytes: int, compiled: bool) -> int:
    """Bytes through device memory for one element of one dynamic cast (module docstring)."""
    return (1 if compiled else 2) * compute_bytes + 1


def cast_bytes(
    spec: ModelSpec,
    policy: PrecisionPolicy,
    tokens: int,
    checkpointing: str,
    compiled: bool,
    tp: int = 1,
    fsdp_shard: int = 1,
    grad_accum: int = 1,
) -> tuple[float, float]:
    """(forward, backward) bytes one rank's dynamic float8 casts move through device memory per micro-batch of
    `tokens` tokens on it (module docstring); backward carries the casts the recompute repeats. 0 without float8.
    Cached per spec (the planner asks for the same setups' casts many times)."""
    if not policy.float8:
        return 0.0, 0.0
    key = ("float8_casts", policy.name, tokens, checkpointing, compiled, tp, fsdp_shard, grad_accum)
    return _memo(
        spec, key, lambda: _cast_bytes(spec, policy, tokens, checkpointing, compiled, tp, fsdp_shard, grad_accum)
    )


def _cast_bytes(
    spec: ModelSpec,
    policy: PrecisionPolicy,
    tokens: int,
    checkpointing: str,
    compiled: bool,
    tp: int,
    fsdp_shard: int,
    grad_accum: int,
) -> tuple[float, float]:
    e = cast_element_bytes(policy.compute_bytes, compiled)
    gathered = policy.float8_all_gather and fsdp_shard > 1
    fwd = bwd = 0.0
    again = {layer: (n, mask) for layer, n, mask in _recomputed(spec, checkpointing)}
    for layer, n in spec.layer_groups:
        redo_n, mask = again.get(layer, (0, []))
        for k, ((name, i, o), c, r) in enumerate(
            zip(layer_matmuls(spec, layer), converted(spec, layer), _replicated(spec, layer))
        ):
            if not c:
                continue
            s_in, s_w, s_go = _shares(policy, name, r, tp)
            inp, weight = e * tokens * i / s_in, (0 if gathered else e * i * o) / s_w
            forward = inp + weight
            fwd += n * forward
            bwd += n * (2 * e * tokens * o / s_go + inp + weight)
            if redo_n and mask[k]:
                bwd += redo_n * forward
    if gathered:
        # The fp32 shard cast before each of a micro-batch's two all-gathers, and the amax precompute's read of the
        # shards once a step (spread over its micro-batches).
        shard = params_per_rank(*linear_params(spec), tp) / fsdp_shard
        per_gather = (policy.param_bytes + 1) * shard
        fwd += per_gather + policy.param_bytes * shard / grad_accum
        bwd += per_gather
    return fwd, bwd


def unsharded_layer_bytes(spec: ModelSpec, compute_bytes: int, tp: int) -> float:
    """One all-gathered block under the float8 all-gather: its converted weights at 1 byte a parameter, the rest in
    the compute dtype; the largest block. Cached per spec."""
    return _memo(spec, ("float8_unsharded", compute_bytes, tp), lambda: _unsharded(spec, compute_bytes, tp))


def _unsharded(spec: ModelSpec, compute_bytes: int, tp: int) -> float:
    best = 0.0
    for layer, _ in spec.layer_groups:
        conv = rep = 0
        for (_, i, o), c, r in zip(layer_matmuls(spec, layer), converted(spec, layer), _replicated(spec, layer)):
            conv += i * o * c
            rep += i * o * (c and r)
        params = spec.params_of(layer)
        conv_rank = params_per_rank(conv, rep, tp)
        # The block's other parameters per rank: as llmctl.plan.memory.estimate counts a block (params / tp).
        best = max(best, (params / tp - conv_rank) * compute_bytes + conv_rank)
    return best


def transient_bytes(
    spec: ModelSpec, policy: PrecisionPolicy, tokens: int, tp: int = 1, fsdp_shard: int = 1
) -> tuple[int, int]:
    """(forward, backward) bytes of the float8 copies one converted linear makes while it runs, the largest one:
    forward its input and weight (not the weight under the float8 all-gather over fsdp_shard > 1 ranks: FSDP's
    unsharded weight is float8 already), backward grad_output twice, the weight and the input; with their scales (one fp32 a tensor under
    tensorwise, one a row along the scaled axis under rowwise). They are freed after the matmul: torchao saves the
    high-precision input and weight for backward, as nn.Linear does (matmul_with_hp_or_float8_args.forward,
    ctx.save_for_backward(input_hp, weight_hp_t)), so the activations are those of bf16-mixed. Cached per spec."""
    if not policy.float8:
        return 0, 0
    gathered = policy.float8_all_gather and fsdp_shard > 1
    key = ("float8_transient", policy.name, tokens, tp, gathered)
    return _memo(spec, key, lambda: _transient(spec, policy, tokens, tp, gathered))


def _transient(spec: ModelSpec, policy: PrecisionPolicy, tokens: int, tp: int, gathered: bool) -> tuple[int, int]:
    rowwise = policy.float8_row_scales
    fwd = bwd = 0.0
    for layer, _ in spec.layer_groups:
        for (name, i, o), c, r in zip(layer_matmuls(spec, layer), converted(spec, layer), _replicated(spec, layer)):
            if not c:
                continue
            s_in, s_w, s_go = _shares(policy, name, r, tp)
            inp, weight = tokens * i / s_in, (0 if gathered else i * o) / s_w
            scales_f = AMAX_BYTES * ((tokens + o) if rowwise else 2)
            scales_b = AMAX_BYTES * ((tokens + o + 2 * i) if rowwise else 4)
            fwd = max(fwd, inp + weight + scales_f)
            bwd = max(bwd, 2 * tokens * o / s_go + inp + weight + scales_b)
    return math.ceil(fwd), math.ceil(bwd)


def summary(spec: ModelSpec, seq_len: int, policy: PrecisionPolicy) -> dict[str, object]:
    """What float8 converts of a model, for estimate-memory's report: the linears converted, the matmuls left in the
    compute dtype (by name, the LM head last), the share of the model FLOPs on float8 tensor cores and whether FSDP
    all-gathers in float8."""
    kept: dict[str, None] = {}
    for layer, _ in spec.layer_groups:
        for (name, _, _), c in zip(layer_matmuls(spec, layer), converted(spec, layer)):
            if not c:
                kept[name] = None
    return {
        "recipe": policy.float8_recipe,
        "compute_dtype": policy.compute_dtype,
        "converted_linears": linear_count(spec),
        "kept_in_compute_dtype": [*kept, "lm_head"],
        "float8_flops_fraction": linear_flops_per_token(spec)[0] / model_flops_per_token(spec, seq_len),
        "float8_all_gather": policy.float8_all_gather,
    }
