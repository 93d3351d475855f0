"""Tensor parallelism with sequence parallelism, with torch's own APIs (`parallelize_module` and its styles), applied
before activation checkpointing, compile and FSDP2 (torchtitan's order, models/llama3/infra/parallelize.py).

What each family splits is its plan in the registry (llmctl.families.tensor_parallel, torch-free); this module
turns the plan's styles into `ParallelStyle`s. Between decoder layers the residual stream is a plain tensor holding
this rank's s/tp tokens; each layer all-gathers it before attention and before the MLP and reduce-scatters after
o_proj and down_proj (forward; backward the mirror). The embedding is split by vocabulary rows and all-reduced
(transformers builds masks and rotary tables from the whole sequence), and the first layer cuts its input to this
rank's sequence shard. The LM head is split by vocabulary and the loss is computed on the vocabulary shards
(`loss_parallel`): logits stay a DTensor sharded on their last dimension.

Under float8 (llmctl.engine.float8, converted before TP as torchtitan does) every linear layer that became a tensorwise
Float8Linear takes torchao's float8 style of the same split, and an attention or MLP input whose consumers all did is
cast to float8 before its all-gather (`PrepareFloat8ModuleInput`, torchtitan's parallelize_llama); layers left in
bf16 (the LM head, odd shapes) and rowwise-scaled ones keep torch's styles.

Parameters the plan does not split (the MoE blocks, MLA's latent projections and norms, replicated over the tp group)
stay plain tensors: their inputs are the same on every rank of the group, so are their gradients (but for MLA's
shared rotary key, which each rank's heads read in part: `sum_shared_key_grads`); gpt-oss's per-head sinks are split
with the heads (`split_head_params`); llmctl.engine.scaler's `grad_norm` sums norms over DTensors of different
meshes (FSDP2's 1-D data-parallel ones and the 2-D data x tp ones), which `clip_grad_norm_` refuses to stack.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from llmctl.engine import float8
from llmctl.errors import SpecError
from llmctl.families import family_of
from llmctl.families import tensor_parallel as tpp
from llmctl.families.modules import decoder_layers

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("llmctl.engine")

DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


def _at(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _styles(*modules: torch.nn.Module | None) -> tuple[type, type, type]:
    """The (colwise, rowwise, module-input) style classes for a split whose linear layers are `modules`: torchao's
    float8 ones when every one of them is a tensorwise Float8Linear, else torch's own."""
    if modules and all(m is not None and float8.tensorwise(m) for m in modules):
        return float8.tp_styles()
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def _consumers(layer: torch.nn.Module, tp_plan: dict[str, str], path: str) -> list[torch.nn.Module | None]:
    """The column-split linear layers under `path` (an attention block's q, k and v): what reads its input."""
    return [_at(layer, p) for p, style in tp_plan.items() if p.startswith(f"{path}.") and style == "colwise"]


def _layer_styles(layer: torch.nn.Module, tp_plan: dict[str, str]) -> dict[str, object]:
    """One decoder layer's {submodule path: ParallelStyle} from the family's tensor-parallel plan (paths the layer
    lacks skipped: a no-rope layer, a layer without q/k norms)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput, SequenceParallel

    styles: dict[str, object] = {}
    for path, style in tp_plan.items():
        module = _at(layer, path)
        if module is None:
            continue
        if style == "norm":
            styles[path] = SequenceParallel()
        elif style == "norm_local":
            styles[path] = SequenceParallel(use_local_output=True)
        elif style == "head_norm":
            # (b, s, heads/tp, head_dim): the local heads are a shard of dimension 2.
            styles[path] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif style == "attention":
            prepare = _styles(*_consumers(layer, tp_plan, path))[2]
            styles[path] = prepare(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        elif style == "latent_attention":
            # The latent projections read the gathered input as plain tensors (replicated weights); the colwise
            # q_b / kv_b read the latents and wrap them as Replicate themselves.
            styles[path] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            )
        elif style == "proj_norm":
            # (b, s, width/tp) local columns -> the whole width, normed with the whole weight -> this rank's columns
            styles[path] = PrepareModuleInputOutput(
                input_layouts=(Shard(-1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(-1),),
                use_local_output=True,
            )
        elif style in ("head_param", "shared_key"):
            continue  # hooks and a split parameter, not a ParallelStyle: split_head_params, sum_shared_key_grads
        elif style == "colwise":
            styles[path] = _styles(module)[0]()
        elif style == "rowwise":
            styles[path] = _styles(module)[1](output_layouts=Shard(1))
        elif style in ("mlp", "mlp_pair"):
            if all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in DENSE_MLP):
                gate, up, down = (getattr(module, n) for n in DENSE_MLP)
                styles[path] = _styles(gate, up)[2](input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                styles[f"{path}.gate_proj"] = _styles(gate)[0]()
                styles[f"{path}.up_proj"] = _styles(up)[0]()
                styles[f"{path}.down_proj"] = _styles(down)[1](output_layouts=Shard(1))
            else:  # a mixture of experts: replicated over the tp group (expert parallelism is a later step)
                if style == "mlp_pair":
                    # Llama 4's MoE returns its output flattened to (b*s, h): back to (b, s, h) before the output is
                    # cut to sequence shards (this hook runs before the style's, registered later).
                    module.register_forward_hook(_unflatten_first_output)
                styles[path] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,
                    # mlp_pair: the router logits, second, pass through as they are
                    output_layouts=(Replicate(),) if style == "mlp" else (Replicate(), None),
                    desired_output_layouts=(Shard(1),) if style == "mlp" else (Shard(1), None),
                    use_local_output=True,
                )
        else:
            raise SpecError(f"unknown tensor-parallel style {style!r} for {path}")
    return styles


def split_head_params(layer: torch.nn.Module, tp_plan: dict[str, str], tp_mesh: DeviceMesh) -> int:
    """Split the layer's per-head parameters (`head_param`: gpt-oss's attention sinks, one logit per head) with the
    heads, Shard(0) over the tp group, and hand the owning module's forward this rank's entries as a plain tensor
    (transformers' attention mixes them with the local heads' plain scores). Returns how many were split."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    n = 0
    for path, style in tp_plan.items():
        owner_path, _, name = path.rpartition(".")
        owner = _at(layer, owner_path) if owner_path else layer
        if style != "head_param" or owner is None or not isinstance(getattr(owner, name, None), torch.nn.Parameter):
            continue
        p = owner._parameters[name]
        if p.shape[0] % tp_mesh.size():
            raise SpecError(f"tp {tp_mesh.size()} does not divide {path}'s {p.shape[0]} heads", hint="set parallel.tp")
        split = distribute_tensor(p.data, tp_mesh, [Shard(0)])
        owner._parameters[name] = type(p)(split, requires_grad=p.requires_grad)

        def local(module: torch.nn.Module, args: tuple, name: str = name) -> None:
            # a plain attribute found before nn.Module.__getattr__ reaches the parameter: the local shard, a view
            # whose gradient flows back to the DTensor parameter (FSDP2's unsharded one inside its forward)
            param = module._parameters[name]
            module.__dict__[name] = param.to_local() if isinstance(param, DTensor) else param

        def drop(module: torch.nn.Module, args: tuple, output: object, name: str = name) -> None:
            module.__dict__.pop(name, None)

        owner.register_forward_pre_hook(local)
        owner.register_forward_hook(drop)
        n += 1
    return n


def sum_shared_key_grads(layer: torch.nn.Module, tp_plan: dict[str, str], tp_mesh: DeviceMesh) -> int:
    """Give each `shared_key` projection (MLA's kv_a_proj_with_mqa, replicated) an output whose last
    qk_rope_head_dim columns, the rotary key every head shares, get their gradient summed over the tp group: each rank's
    attention adds up the key's gradient over its own heads only. The latent columns before them are left alone (their
    gradient comes back whole through kv_b_proj's colwise backward). Returns how many projections were hooked."""
    group, n = tp_mesh.get_group(), 0
    for path, style in tp_plan.items():
        module = _at(layer, path)
        owner = _at(layer, path.rpartition(".")[0]) if "." in path else layer
        if style != "shared_key" or module is None:
            continue
        width = int(owner.qk_rope_head_dim)

        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor, width: int = width) -> torch.Tensor:
            return _shared_key_grad().apply(output, width, group)

        module.register_forward_hook(hook)
        n += 1
    return n


@functools.cache
def _shared_key_grad() -> type:
    """An autograd function (built on first use: torch is imported lazily here): identity forward; backward, the
    gradient's last `width` columns all-reduced (summed) over `group`."""
    import torch
    import torch.distributed as dist

    class SharedKeyGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, width: int, group: object) -> torch.Tensor:  # noqa: ANN001
            ctx.width, ctx.group = width, group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
            grad = grad.clone()
            key = grad[..., -ctx.width :].contiguous()
            dist.all_reduce(key, group=ctx.group)
            grad[..., -ctx.width :] = key
            return grad, None, None

    return SharedKeyGrad


def _unflatten_first_output(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    """A (b*s, h) first output shaped as the block's (b, s, h) input."""
    return (output[0].view(args[0].shape), *output[1:])


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split `model` (a transformers causal LM on the meta device) over `tp_mesh` with its family's plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mt = str(getattr(model.config, "model_type", "")) or type(model).__name__
    fam = family_of(mt)
    refusal = tpp.family_refusal(mt, fam)  # the rule the plan asked (spec.rules 'tp plan'), on the built model
    if refusal:
        raise SpecError(refusal, hint="set parallel.tp: 1")
    assert fam is not None and fam.tp_plan is not None
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    root = {k: _at(model, v) for k, v in tpp.ROOT.items()}
    missing = [tpp.ROOT[k] for k, m in root.items() if m is None]
    if missing:
        raise SpecError(f"{mt}: no {', '.join(missing)} to split for tensor parallelism", hint="set parallel.tp: 1")
    vocab = root["embed"].weight.shape[0]
    if vocab % tp_mesh.size():
        raise SpecError(
            f"the padded vocabulary {vocab} is not divisible by tp {tp_mesh.size()}",
            hint="set model.pad_vocab_multiple to a multiple of tp",
        )
    parallelize_module(
        model,
        tp_mesh,
        {
            tpp.ROOT["embed"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            tpp.ROOT["norm"]: SequenceParallel(),
            tpp.ROOT["head"]: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    layers = decoder_layers(model)
    float8_styles = 0
    for i, layer in enumerate(layers):
        styles = _layer_styles(layer, dict(fam.tp_plan))
        if i == 0:  # the whole sequence in, this rank's s/tp tokens out to the residual stream
            parallelize_module(
                layer,
                tp_mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
            )
        parallelize_module(layer, tp_mesh, styles)
        split_head_params(layer, dict(fam.tp_plan), tp_mesh)
        sum_shared_key_grads(layer, dict(fam.tp_plan), tp_mesh)
        float8_styles += float8.count_linear_styles(styles.values())
    if float8_styles and tp_mesh.device_type == "cpu":
        float8.gather_as_bytes()
    if tied:  # the embedding and the head are both split by vocabulary rows (Shard(0)): one parameter again
        root["head"].weight = root["embed"].weight
    log.info(
        "tensor parallel: tp %d, %s plan over %d layers%s",
        tp_mesh.size(),
        fam.family,
        len(layers),
        f", {float8_styles} float8 linear layers on torchao's float8 styles" if float8_styles else "",
    )


def select_async_tp(requested: bool, cuda_available: bool, compiled: bool) -> tuple[bool, str]:
    """(on, why): async TP (symmetric-memory micro-pipelining of TP's all-gather / reduce-scatter with the matmuls,
    an inductor pass) runs where asked on CUDA with compile; elsewhere the run goes on without it, and says so."""
    if not requested:
        return False, "parallel.async_tp off"
    if not cuda_available:
        return False, "async TP asked, but it needs CUDA (symmetric memory): TP's collectives run unpipelined"
    if not compiled:
        return False, "async TP asked, but it is an inductor pass: it needs training.compile"
    return True, "async TP on: TP's collectives micro-pipelined with their matmuls"


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Turn on inductor's micro-pipelined TP for the compiled layers, with symmetric memory for the tp group
    (torchtitan's maybe_enable_async_tp, torchtitan/distributed/tensor_parallel.py)."""
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
