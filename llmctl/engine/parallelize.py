"""Apply the parallelism to a built model, in one fixed order (torchtitan's `parallelize_llama`):
activation checkpointing -> torch.compile -> FSDP2 `fully_shard` per decoder layer, then the root.

Sharding strategies, all with FSDP2 (never FSDP1: its HYBRID_SHARD without a device mesh silently stops syncing
gradients, measured on gloo: ranks diverge with no error):
- full:     1-D mesh ("shard",) over every rank (ZeRO-3).
- hybrid:   2-D mesh ("replicate", "shard"): parameters sharded inside a group, replicated across groups (HSDP).
- no_shard: the same 2-D HSDP mesh with shard size 1, i.e. (world, 1): every rank holds full parameters and
            gradients are all-reduced across the replicate dimension (DDP semantics). Keeping it on FSDP2 rather
            than DistributedDataParallel keeps one code path for grad-accumulation (`set_requires_gradient_sync`),
            mixed precision and DCP checkpoints (a no_shard checkpoint loads into a full-shard run).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from llmctl.engine.watchdog import with_plan_timeout
from llmctl.errors import InputError, SpecError
from llmctl.families.modules import decoder_layers, outer_units
from llmctl.spec import checkpointing as ckpt_modes
from llmctl.spec.precision import PrecisionPolicy, policy
from llmctl.spec.rules import model_problem

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from llmctl.spec.models import ModelSpec
    from llmctl.spec.parallel import ParallelDims
    from llmctl.spec.planfile import HardwareSection
    from llmctl.spec.setup import TrainSetup

log = logging.getLogger("llmctl.engine")


def check_world(hardware: HardwareSection, world_size: int) -> None:
    """The ranks torchrun started are the plan's hardware (one line saying how to start it when they are not)."""
    planned = hardware.nodes * hardware.nproc_per_node
    if planned != world_size:
        raise InputError(
            f"the plan is for {planned} ranks (hardware.nodes x hardware.nproc_per_node) but {world_size} were started",
            hint=f"start it with torchrun --nproc_per_node {hardware.nproc_per_node} --nnodes {hardware.nodes}",
        )


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The device mesh of the parallel degrees (spec.parallel.ParallelDims.mesh_dims: shape and dimension names)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = dims.mesh_dims
    return with_plan_timeout(init_device_mesh(device_type, shape, mesh_dim_names=names))


def mixed_precision(precision: str | PrecisionPolicy):  # -> MixedPrecisionPolicy | None
    """FSDP2's policy for a mixed precision: parameters gathered and computed in the compute dtype, gradients reduced
    in the reduce dtype (bf16-mixed: bf16 / fp32, docs/sources.md#fsdp-seed); None where the model is built in its
    training dtype (fp32, pure bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from llmctl.engine.model import torch_dtype

    p = policy(precision)
    p.check_engine()
    if p.mixed:
        return MixedPrecisionPolicy(param_dtype=torch_dtype(p.compute_dtype), reduce_dtype=torch_dtype(p.reduce_dtype))
    return None


MATMULS = ("mm", "addmm", "_scaled_mm")
"""The matmul ops selective checkpointing counts (every other one saved)."""


def _sac_save_ops() -> set:
    """Ops whose outputs selective checkpointing keeps: matmuls (every other one, see _sac_policy) and every
    attention kernel (SDPA's flash / memory-efficient / cuDNN / CPU flash variants, and flash-attn's own op when that
    package registers one). torchtitan's `_save_list` (models/llama3/infra/parallelize.py) is the reference; addmm
    is added because GPT-2's Conv1D runs its projections as addmm, and _scaled_mm because float8's Float8Linear runs
    its matmuls as _scaled_mm (torchtitan's list has it too)."""
    import torch

    aten = torch.ops.aten
    names = (
        *MATMULS,
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    fa = getattr(torch.ops, "flash_attn", None)
    for n in ("_flash_attn_forward", "_flash_attn_varlen_forward"):
        op = getattr(fa, n, None) if fa is not None else None
        if op is not None:
            ops.add(op.default)
    return ops


def _sac_context_fn():
    """A fresh (forward, recompute) context pair per checkpointed call: the matmul counter restarts for every layer
    and counts forward and recompute separately, so both pick the same matmuls."""
    from collections import defaultdict

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _sac_save_ops()
    matmuls = {getattr(torch.ops.aten, n).default for n in MATMULS}
    count: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            count[mode] += 1
            # Keep the 1st, 3rd, 5th... matmul of the layer, recompute the others (torchtitan's rule: half of the
            # matmul outputs kept for about half of their memory; the kept ones are q, v, gate and down in a
            # Llama block, so what is recomputed in backward is k, o, up and the cheap ops around them).
            keep = count[mode] % 2 == 1
        else:
            keep = func in save
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Wrap decoder layers with non-reentrant checkpointing per the mode (llmctl.spec.checkpointing): `full` and
    `partial:K` wrap whole layers, `selective` wraps every layer with the op-level policy above."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if mode == "none":
        return
    layers = decoder_layers(model)
    # Without this, HF layers try to build a KV cache in the recomputed forward (shape error in backward).
    model.config.use_cache = False
    if mode == "selective":
        for i, layer in enumerate(layers):
            if _absent(layer):
                continue
            # The RNG state is replayed only when the model draws random numbers (dropout): then the recompute must
            # draw the same masks. torchtitan passes False (its models have no dropout); replaying costs an RNG-state
            # copy per layer.
            layers[i] = checkpoint_wrapper(
                layer,
                checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                context_fn=_sac_context_fn,
                preserve_rng_state=_has_dropout(model),
            )
        return
    for i in ckpt_modes.whole_layers(mode, len(layers)):
        if _absent(layers[i]):
            continue
        layers[i] = checkpoint_wrapper(
            layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=_has_dropout(model)
        )


def _has_dropout(model: torch.nn.Module) -> bool:
    """Whether the model draws random numbers in forward (a dropout with p > 0): then the recompute must replay the
    RNG state so it draws the same masks."""
    import torch

    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def apply_compile(model: torch.nn.Module) -> None:
    """Compile each decoder layer on its own (all layers share one graph; torchtitan does the same)."""
    for layer in decoder_layers(model):
        if not _absent(layer):
            layer.compile()


def apply_fsdp(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    precision: str | PrecisionPolicy,
    offload: bool = False,
    reshard_after_forward: bool | None = None,
) -> None:
    """fully_shard the embeddings, every decoder layer, the final norm + LM head, then the root (what is left, and
    tied embeddings with their head); with `offload`, FSDP2's CPUOffloadPolicy on every group (host memory pinned
    where there is a GPU to copy to). `reshard_after_forward` False: no group reshards after forward (a pipeline
    stage: llmctl.engine.pipeline); None: every layer but the last."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from llmctl.engine.experts import shard_experts

    mp = mixed_precision(precision)
    kwargs: dict[str, Any] = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    # torchtitan's units: the embeddings on their own (gathered for their forward and again at the end of backward,
    # not held between), the final norm + LM head together, kept gathered from the end of forward into backward,
    # where they are needed first. In the root (today's single unit) both were held unsharded from the first forward
    # to the last backward (issue 47: 3.9 GiB per GPU for 70B). Tied embeddings stay in the root. Pipeline stages
    # keep their own choice (`reshard_after_forward` given).
    emb, tail = outer_units(model) if reshard_after_forward is None else (None, [])
    if emb is not None:
        fully_shard(emb, **kwargs)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        if _absent(layer):
            continue
        # The last layer's parameters are needed again right at the start of backward: keep them gathered
        # (torchtitan's reshard_after_forward choice).
        reshard = i < len(layers) - 1 if reshard_after_forward is None else reshard_after_forward
        shard_experts(layer, reshard_after_forward=reshard, **kwargs)  # expert parallelism's own mesh
        for part in odd_dtype_modules(layer):
            fully_shard(part, reshard_after_forward=reshard, **kwargs)
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    if tail:
        fully_shard(tail, reshard_after_forward=False, **kwargs)
    if reshard_after_forward is None:
        fully_shard(model, **kwargs)
    else:
        fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def _absent(layer: torch.nn.Module) -> bool:
    """A decoder layer another pipeline stage holds (llmctl.engine.pipeline's Absent): nothing to wrap or shard."""
    return bool(getattr(layer, "pipeline_absent", False))


def odd_dtype_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest submodules whose parameters all have one dtype other than the layer's main one. FSDP2 all-gathers
    a group's parameters as one flat buffer and refuses mixed dtypes; transformers keeps some parameters in fp32 in
    a bf16 model (DeepSeek-V3's router `gate.weight`, its `_keep_in_fp32_modules_strict`), so each such module is
    sharded as a group of its own, before its layer."""
    from collections import Counter

    counts = Counter(p.dtype for p in layer.parameters())
    if len(counts) < 2:
        return []
    main = counts.most_common(1)[0][0]
    found: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        dtypes = {p.dtype for p in module.parameters()}
        if len(dtypes) == 1 and main not in dtypes:
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(layer)
    return found


def needs_fsdp(mesh_size: int, precision: str | PrecisionPolicy, offload: bool = False, adapters: bool = False) -> bool:
    """Whether FSDP2 wraps the model on a data-parallel mesh of `mesh_size` ranks: llmctl.spec.setup.fsdp_wraps, the
    rule the memory model asks too."""
    from llmctl.spec.setup import fsdp_wraps

    return fsdp_wraps(mesh_size, policy(precision).mixed, offload, adapters)


def apply_autocast(model: torch.nn.Module, compute_dtype: str, device_type: str) -> None:
    """Every call of `model` (training, evaluation; activation checkpointing's recompute restores it) under
    torch.autocast to the compute dtype: what FSDP2's mixed-precision policy does for a run without FSDP2 (one rank
    with adapters). The frozen base is stored in the compute dtype, so only the fp32 adapters are cast, at their use;
    their gradients come back in fp32, as FSDP2's reduce dtype gives them."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[compute_dtype]
    active: list[torch.autocast] = []

    def enter(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        ctx = torch.autocast(device_type, dtype=dtype)
        ctx.__enter__()
        active.append(ctx)

    def leave(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of the mesh (every dimension but pp and tp): what FSDP2 shards and replicates over. A cp
    group shards the states as data-parallel ranks do: shard and cp are flattened into one `shard_cp` dimension
    (torchtitan's dp_shard_cp), so HSDP stays 2-D (replicate, shard_cp)."""
    names = tuple(n for n in mesh.mesh_dim_names or () if n not in ("tp", "pp"))
    if "cp" in names:
        flat = mesh["shard", "cp"]._flatten("shard_cp")
        if "replicate" not in names:
            return flat
        import warnings

        with warnings.catch_warnings():  # torch 2.13 still slices a flattened dimension from the root; no other way
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")  # to get a 2-D HSDP mesh over it
            return mesh["replicate", "shard_cp"]
    return mesh[names] if names != tuple(mesh.mesh_dim_names or ()) else mesh


def apply_experts(model: torch.nn.Module, s: TrainSetup, mesh: DeviceMesh) -> None:
    """Expert parallelism over the experts' mesh (llmctl.engine.experts) where ep > 1; the rows-per-expert count
    of every MoE model either way."""
    from llmctl.engine.experts import apply_ep, expert_mesh, watch_load

    emesh = expert_mesh(s.dims, mesh.device_type, mesh)
    if emesh is not None:
        n = apply_ep(model, emesh)
        log.info(
            "expert parallelism: %d MoE layers' experts over ep %d, FSDP over %d (mesh %s)",
            n,
            s.ep,
            s.dims.expert_shard,
            dict(zip(emesh.mesh_dim_names or (), emesh.shape)),
        )
    watch_load(model)


def parallelize(model: torch.nn.Module, spec: ModelSpec, s: TrainSetup, mesh: DeviceMesh) -> bool:
    """Apply TP -> AC -> compile -> FSDP2 in place (torchtitan's order) to `model`, built from `spec` (vocabulary
    padded) for setup `s`; returns whether FSDP2 was applied."""
    if s.dims.tp_enabled:
        from llmctl.engine.tensor_parallel import apply_tp, enable_async_tp, select_async_tp

        problem = model_problem(s, spec, only=("tp plan",))
        if problem:
            raise SpecError(problem.message, hint="choose a parallel.tp that divides it, or 1")
        apply_tp(model, mesh["tp"])
        on, why = select_async_tp(s.async_tp, mesh.device_type == "cuda", s.compile)
        if on:
            enable_async_tp(mesh["tp"])
        if s.async_tp:
            log.log(logging.INFO if on else logging.WARNING, why)
    apply_experts(model, s, mesh)
    apply_activation_checkpointing(model, s.checkpointing)
    if s.compile:
        apply_compile(model)
    dp = dp_mesh(mesh)
    fsdp = needs_fsdp(dp.size(), s.precision, s.levers.offload, s.finetune.adapters)
    if fsdp:
        apply_fsdp(model, dp, s.precision, s.levers.offload)
    elif s.precision.mixed:  # one rank with adapters (llmctl.spec.setup.fsdp_wraps): the compute dtype by autocast
        apply_autocast(model, s.precision.compute_dtype, mesh.device_type)
    log.info(
        "parallelized: mesh %s %s, fsdp2 %s, checkpointing %s, compile %s, precision %s%s",
        tuple(mesh.shape),
        mesh.mesh_dim_names,
        fsdp,
        s.checkpointing,
        s.compile,
        s.precision.name,
        ", CPU offload" if s.levers.offload else "",
    )
    return fsdp
