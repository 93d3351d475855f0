"""Expert parallelism: each MoE layer's routed experts split over the ep ranks, tokens sent to their experts.

What a rank owns is llmctl.spec.experts' (torchtitan's layout): the experts' 3-D weights (and gpt-oss's biases) become
DTensors sharded by expert (Shard(0)) over the ep dimension of the experts' mesh (`ParallelDims.expert_mesh_dims`),
then FSDP2 shards each rank's local experts over the efsdp dimension (with replicas under HSDP), dividing their
gradients by the dense group's size: an expert's gradient on its rank sums the contributions of every rank of its ep
group (the combine's backward brings them), so dividing by the dense data-parallel size gives the same mean as at
ep 1. A checkpoint holds the whole (E, ...) tensors (DCP reshards them), so a run resumes at another ep degree.

One MoE layer's experts forward (dropless, token choice; transformers' router upstream is untouched, in fp32 where
the family says so):
1. sort this rank's (token, expert) rows by expert; exchange the per-expert counts (one all-to-all of E integers,
   and a host sync: the split sizes are a host list);
2. dispatch: `all_to_all_single` of the rows with uneven splits (autograd: its backward is the reverse all-to-all);
3. the received rows regrouped by local expert and run as two grouped GEMMs (`torch._grouped_mm`: gate_up, the
   family's activation, down), with the family's layout flags (transposed weights, interleaved gate/up, biases) that
   transformers' `use_experts_implementation` sets on the module;
4. combine: the reverse all-to-all, rows back in their tokens' order, weighted by the router's scores and summed
   over the top-k.
No overlap of the all-to-alls with compute (the cost model prices them serial).

Tokens per expert: each experts module counts the rows its router sent to each expert (`load`), which the trainer
reads as min/max over mean per step (llmctl.engine.metrics): a forced imbalance shows there.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from llmctl.spec.parallel import ParallelDims

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj", "up_proj", "gate_up_proj_bias", "down_proj_bias", "up_proj_bias")
"""transformers' routed-experts parameters (`use_experts_implementation` modules): (E, ...) each, split by expert."""


@dataclass
class ExpertGroup:
    """An experts module's place in the ep group (set on the module as `_llmctl_ep`)."""

    group: Any
    """The ep process group."""
    size: int
    rank: int
    fsdp_mesh: Any
    """What FSDP2 shards this rank's local experts over: (replicate, efsdp) or (efsdp,)."""


def is_experts(module: torch.nn.Module) -> bool:
    """A transformers routed-experts module: 3-D expert weights and the experts-implementation flags (Mixtral,
    Qwen3-MoE, DeepSeek-V3, gpt-oss). Llama 4's Llama4TextExperts runs every token through every expert (no top-k
    dispatch) and is not one."""
    w = getattr(module, "gate_up_proj", None)
    return w is not None and getattr(w, "ndim", 0) == 3 and hasattr(module, "is_transposed")


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_experts(m)]


_MESHES: dict[int, tuple[Any, DeviceMesh]] = {}


def expert_mesh(dims: ParallelDims, device_type: str, main: DeviceMesh) -> DeviceMesh | None:
    """The experts' device mesh (`ParallelDims.expert_mesh_dims`), one per main mesh (its process groups are made
    once); None at ep 1."""
    from torch.distributed.device_mesh import init_device_mesh

    from llmctl.engine.watchdog import with_plan_timeout

    if not dims.ep_enabled:
        return None
    held = _MESHES.get(id(main))
    if held is not None and held[0] is main:
        return held[1]
    shape, names = dims.expert_mesh_dims
    mesh = with_plan_timeout(init_device_mesh(device_type, shape, mesh_dim_names=names))
    _MESHES.clear()  # a process runs one engine at a time (tests run several plans in turn)
    _MESHES[id(main)] = (main, mesh)
    return mesh


class _NormHint(logging.Filter):
    """Drops DTensor's advice to flatten (efsdp, ep) that the global gradient norm's full_tensor of a scalar prints
    on every rank at every step: two all-reduces of one number where one would do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flatten mesh dimensions" not in record.getMessage()


_HINT = _NormHint()


def apply_ep(model: torch.nn.Module, mesh: DeviceMesh) -> int:
    """Shard every routed-experts module of `model` by expert over mesh["ep"] and give it the dispatching forward;
    returns how many modules. Before activation checkpointing, compile and FSDP2 (torchtitan's order)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_HINT)
    ep_mesh = mesh["ep"]
    names = mesh.mesh_dim_names or ()
    fsdp_mesh = mesh["replicate", "efsdp"] if "replicate" in names else mesh["efsdp"]
    found = experts_modules(model)
    for m in found:
        if m.num_experts % ep_mesh.size():
            raise ValueError(f"ep {ep_mesh.size()} does not divide {m.num_experts} experts")  # the ep rule's case
        for name in EXPERT_WEIGHTS:
            p = getattr(m, name, None)
            if isinstance(p, torch.nn.Parameter):
                d = distribute_tensor(p.data, ep_mesh, [Shard(0)])
                setattr(m, name, torch.nn.Parameter(d, requires_grad=p.requires_grad))
        m._llmctl_ep = ExpertGroup(ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank(), fsdp_mesh)
        m.forward = types.MethodType(dispatch_forward, m)
    return len(found)


def shard_experts(layer: torch.nn.Module, **fsdp_kwargs: Any) -> None:
    """FSDP2 over each expert-parallel experts module of `layer` (before the layer's own fully_shard, which then
    leaves their parameters out). FSDP2 divides their gradients by its own group's size (replicate x efsdp); the
    forward scales them by 1/ep more (`_GradScale`), so they are divided by the dense group's size, as at ep 1.
    (FSDP2's set_gradient_divide_factor would do it in the reduce-scatter, but as a PREMUL_SUM, which gloo lacks.)"""
    from torch.distributed.fsdp import fully_shard

    for m in experts_modules(layer):
        grp = getattr(m, "_llmctl_ep", None)
        if grp is None:
            continue
        fully_shard(m, **{**fsdp_kwargs, "mesh": grp.fsdp_mesh})


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _grad_scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    """`t` as it is, its gradient multiplied by `scale` in backward."""
    import torch

    class _GradScale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad * scale

    return _GradScale.apply(t) if scale != 1.0 else t


def _count(module: Any, counts: torch.Tensor) -> None:
    """Accumulate the rows routed to each expert (see `load`); not in backward, where activation checkpointing
    runs the forward again."""
    import torch

    if torch._C._current_graph_task_id() != -1:
        return
    held = getattr(module, "_llmctl_load", None)
    c = counts.detach()
    module._llmctl_load = c.clone() if held is None else held + c


def _count_hook(module: Any, args: tuple, kwargs: dict) -> None:
    import torch

    idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
    if idx is not None:
        _count(module, torch.bincount(idx.reshape(-1), minlength=module.num_experts))


def watch_load(model: torch.nn.Module) -> int:
    """Count the rows per expert of every experts module that does not dispatch (ep 1; the dispatching forward
    counts its own); returns how many experts modules the model has."""
    found = experts_modules(model)
    for m in found:
        if getattr(m, "_llmctl_ep", None) is None:
            m.register_forward_pre_hook(_count_hook, with_kwargs=True)
    return len(found)


def grouped_experts(module: Any, rows: torch.Tensor, per_expert: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
    """The local experts over `rows` sorted by local expert (`per_expert` rows each): two grouped GEMMs with the
    family's activation between them, biases per row where the family has them; the weights' gradients multiplied
    by `grad_scale` (see `shard_experts`)."""
    import torch

    def weight(name: str) -> torch.Tensor:
        return _grad_scaled(_local(getattr(module, name)), grad_scale)

    offs = torch.cumsum(per_expert, 0).to(torch.int32)
    ids = torch.repeat_interleave(torch.arange(per_expert.numel(), device=rows.device), per_expert)
    gate_up = weight("gate_up_proj" if module.has_gate else "up_proj")
    x = rows.to(gate_up.dtype)
    if x.shape[0] == 0:
        # A rank that received no rows still runs both GEMMs on one row past offs (never read), joined to `rows`:
        # the graph must reach the dispatch's all-to-all, whose backward every rank of the ep group has to join
        # (cut here, the peers wait for this rank forever), and grouped_mm's backward refuses an empty input's
        # gradient layout.
        x = torch.cat([x, x.new_zeros((1, x.shape[1]))])
        ids = torch.cat([ids, ids.new_zeros(1)])
    h = torch._grouped_mm(x, gate_up if module.is_transposed else gate_up.transpose(-2, -1), offs=offs)
    if module.has_bias:
        h = h + weight("gate_up_proj_bias" if module.has_gate else "up_proj_bias")[ids]
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    down = weight("down_proj")
    out = torch._grouped_mm(h.contiguous(), down if module.is_transposed else down.transpose(-2, -1), offs=offs)
    if module.has_bias:
        out = out + weight("down_proj_bias")[ids]
    return out[: rows.shape[0]]


def dispatch_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts' forward under expert parallelism (transformers' experts signature: (tokens, hidden), (tokens,
    k) expert ids, (tokens, k) router weights -> (tokens, hidden)); see the module's docstring."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    grp: ExpertGroup = self._llmctl_ep
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    experts, local = self.num_experts, self.num_experts // grp.size
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    _count(self, counts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=grp.group)  # [src rank][local expert]
    send = counts.view(grp.size, local).sum(1).tolist()
    recv_grid = received.view(grp.size, local)
    recv = recv_grid.sum(1).tolist()
    rows = all_to_all_single_autograd(hidden_states[order // k], recv, send, grp.group)
    # rows arrive by (source rank, local expert): regroup by local expert for the grouped GEMMs, then back
    local_ids = torch.arange(local, device=flat.device).repeat(grp.size)
    by_expert = torch.argsort(torch.repeat_interleave(local_ids, received.view(-1)), stable=True)
    out = grouped_experts(self, rows[by_expert], recv_grid.sum(0), 1.0 / grp.size)
    out = out[torch.argsort(by_expert)]
    back = all_to_all_single_autograd(out, send, recv, grp.group)
    back = back[torch.argsort(order)].view(tokens, k, hidden)
    weighted = back * top_k_weights.unsqueeze(-1).to(back.dtype)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def load(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each experts module's rows per expert since the last call (then reset), in module order."""
    out = []
    for m in experts_modules(model):
        held = getattr(m, "_llmctl_load", None)
        if held is not None:
            out.append(held)
            m._llmctl_load = None
    return out


def load_fields(model: torch.nn.Module, steps: int, whole_world: bool) -> dict[str, float]:
    """A step record's expert-load fields: rows (token x top-k choices) routed to each expert of each MoE layer per
    step, averaged over the `steps` since the last record: min, max and mean over (layer, expert), and the imbalance
    (the largest layer's max over its mean: what a dropless ep rank holding that expert receives over its balanced
    share). Summed over every rank when `whole_world` (every rank holds every MoE layer: pp 1); else this rank's
    tokens. {} for a dense model."""
    import torch
    import torch.distributed as dist

    counts = load(model)
    if not counts:
        return {}
    grid = torch.stack([c.to(torch.float64) for c in counts]) / max(1, steps)
    if whole_world and dist.is_initialized():
        grid = grid.to(counts[0].device)
        dist.all_reduce(grid)
    mean = grid.mean(dim=1).clamp(min=1e-12)
    return {
        "expert_tokens_min": float(grid.min()),
        "expert_tokens_max": float(grid.max()),
        "expert_tokens_mean": float(grid.mean()),
        "expert_imbalance": float((grid.max(dim=1).values / mean).max()),
    }


@dataclass
class AuxLoss:
    """The family's auxiliary load-balancing loss (Switch Transformer's, as transformers computes it in its MoE
    causal LMs when output_router_logits is set): every MoE layer's router logits of one micro-batch, recorded by
    forward hooks on the router modules the model's `_can_record_outputs` names (not again in activation
    checkpointing's recompute), turned into `coef` x load_balancing_loss_func(logits, E, top-k) by `take`. This
    rank's tokens only, as transformers' and torchtitan's per-micro-batch losses."""

    func: Any
    coef: float
    experts: int
    top_k: int
    logits: list = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.logits = []

    def record(self, index: int) -> Any:
        import torch

        def hook(module: Any, args: tuple, output: Any) -> None:
            if torch._C._current_graph_task_id() == -1:
                self.logits.append(output[index] if isinstance(output, tuple) else output)

        return hook

    def take(self) -> torch.Tensor:
        """coef x the loss over the logits recorded since the last call (then forgotten)."""
        logits, self.logits = tuple(self.logits), []
        return self.coef * self.func(logits, self.experts, self.top_k)


def aux_loss(model: torch.nn.Module) -> AuxLoss:
    """The model's auxiliary load-balancing loss, its hooks installed (SpecError where transformers' family has
    none: DeepSeek-V3 balances its experts with a bias instead)."""
    import importlib

    from llmctl.errors import SpecError

    cfg = model.config
    # FSDP2 wraps the class (FSDPQwen3MoeForCausalLM): transformers' own is further up its MRO
    own = next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")), type(model))
    module = importlib.import_module(own.__module__)
    func = getattr(module, "load_balancing_loss_func", None)
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    if recorder is None:  # the base model's class declares it
        base = getattr(model, "model", None)
        recorder = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    coef = getattr(cfg, "router_aux_loss_coef", None)
    if func is None or recorder is None or not coef:
        raise SpecError(
            f"training.moe_aux_loss: transformers' {cfg.model_type} has no auxiliary load-balancing loss "
            "(DeepSeek-V3 balances its experts with a routing bias instead)",
            hint="leave training.moe_aux_loss out",
        )
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    loss = AuxLoss(func, float(coef), int(experts), int(cfg.num_experts_per_tok))
    target = recorder.target_class
    for m in model.modules():
        if isinstance(m, target):
            m.register_forward_hook(loss.record(recorder.index))
    return loss
