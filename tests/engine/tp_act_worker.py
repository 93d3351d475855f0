"""Activations under tensor + sequence parallelism and context parallelism, measured on real gloo ranks
(`torchrun --nproc_per_node N tp_act_worker.py OUT.json PLAN [PLAN ...]`): each plan's model is built with the engine's
own pieces (meta build, ring attention, parallelize: TP -> activation checkpointing -> FSDP2, materialize) and run one
forward and its loss (loss parallel under tp > 1, the rank's part of the sequence under cp > 1, as the trainer does),
while the saved-bytes harness (llmctl.measure.saved) records what autograd saves for backward and what a checkpointed
layer holds (its inputs).

A DTensor is counted by its local tensor (what the rank holds), each storage once; parameters are not activations:
every module's own parameters are excluded as it is called (FSDP2 all-gathers them into fresh unsharded storages
just before). Each saved storage is charged to the region current when it was first saved: decoder layer i, "norm"
(the final norm), "head" (the LM head) or "outside" (the embedding and the loss).

Rank 0 writes {plan: {"ranks": [{region: bytes} per rank]}} (or {"error"}); with LLMCTL_TP_ACT_DETAIL=1 also each
storage counted on rank 0, in the order first saved: its region, shape and dtype ("detail").
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from engine_runs import finish  # this script's folder is on sys.path

from llmctl.engine.context_parallel import SequenceSplit, cp_mesh, install_cpu_ring, use_ring_attention, whole
from llmctl.engine.data import Batch
from llmctl.engine.loss import model_loss, select_loss
from llmctl.engine.model import Values, base_spec, build_meta_model, materialize, model_spec_for, select_attention
from llmctl.engine.parallelize import build_mesh, parallelize
from llmctl.families import tensor_parallel as tpp
from llmctl.families.modules import decoder_layers
from llmctl.measure.saved import OUTSIDE, SavedBytes
from llmctl.spec.planfile import load_plan


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local tensor (a collective's pending result waited for)."""
    from torch.distributed.tensor import DTensor

    while True:
        if isinstance(t, DTensor):
            t = t._local_tensor
        elif type(t).__name__ == "AsyncCollectiveTensor":
            t = t.trigger_wait()
        else:
            return t


class LocalSavedBytes(SavedBytes):
    """SavedBytes over DTensors: each counted (and excluded) by its local tensor's storage."""

    def __init__(self, detail: bool = False) -> None:
        super().__init__()
        self.detail: list[dict] | None = [] if detail else None

    def exclude(self, t: torch.Tensor) -> None:
        super().exclude(local(t))

    def keep(self, t: torch.Tensor) -> None:
        t = local(t)
        before = len(self._saved)
        super().keep(t)
        if self.detail is not None and len(self._saved) > before:
            self.detail.append({"region": str(self.region), "shape": list(t.shape), "dtype": str(t.dtype)[6:]})


def _at(root: torch.nn.Module, path: str) -> torch.nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


@contextlib.contextmanager
def _sac_cache_kept(saved: SavedBytes) -> Iterator[None]:
    """Selective checkpointing keeps the outputs its policy saves in its own cache, which saved_tensors_hooks never
    sees: each cached tensor (torch.utils.checkpoint wraps each in a _VersionWrapper) is counted as kept too."""
    from torch.utils import checkpoint

    original = checkpoint._VersionWrapper.__init__

    def init(self: object, val: object) -> None:
        original(self, val)
        if isinstance(val, torch.Tensor):
            saved.keep(val)

    checkpoint._VersionWrapper.__init__ = init
    try:
        yield
    finally:
        checkpoint._VersionWrapper.__init__ = original


def _region(saved: SavedBytes, module: torch.nn.Module, name: str) -> None:
    """`name` is the region while `module` runs."""

    def enter(mod: torch.nn.Module, args: tuple) -> None:
        saved.region = name

    def leave(mod: torch.nn.Module, args: tuple, output: object) -> None:
        saved.region = OUTSIDE

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def measure(path: str, world: int, detail: bool) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel

    plan = load_plan(path)
    t, setup = plan.training, plan.setup
    attn, _ = select_attention(t.attention, False, False, setup.cp)
    mesh = build_mesh(plan.setup.dims, "cpu")
    model = build_meta_model(model_spec_for(plan.model), plan.setup, attn)
    ring = cp_mesh(mesh)
    split = whole if ring is None else SequenceSplit(ring, setup.cp_load_balance, setup.cp_rotate)
    if ring is not None:
        use_ring_attention(model)
        install_cpu_ring()
    parallelize(model, model_spec_for(plan.model), plan.setup, mesh)
    materialize(model, plan.setup, torch.device("cpu"), Values(plan.training.seed, base_spec(plan.model).vocab_size))
    model.train()
    vocab = base_spec(plan.model).vocab_size
    impl, _ = select_loss(0, False, False, setup.tp)
    ids = torch.randint(0, vocab, (t.micro_batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    saved = LocalSavedBytes(detail)

    def exclude_params(mod: torch.nn.Module, args: tuple) -> None:
        for p in mod.parameters(recurse=False):
            saved.exclude(p)

    for m in model.modules():  # each module's parameters as it runs (FSDP2 has just unsharded them)
        m.register_forward_pre_hook(exclude_params)
    for b in model.buffers():
        saved.exclude(b)
    layers = list(decoder_layers(model))
    # A checkpointed layer holds its inputs until its backward (the recompute's arguments): counted as kept.
    saved.track(layers, keep_inputs=setup.checkpointing != "none")
    for name in ("norm", "head"):
        _region(saved, _at(model, tpp.ROOT[name]), name)
    with split(Batch(inputs, targets)) as part, contextlib.ExitStack() as stack:
        if impl == "parallel":
            stack.enter_context(loss_parallel())
        with saved, _sac_cache_kept(saved):
            loss = model_loss(model, impl, part.inputs, part.targets, vocab, positions=part.positions)
        assert loss.requires_grad
        regions = {str(k): v for k, v in saved.by_region().items()}
        loss.backward()
    out = {"regions": regions}
    if detail:
        out["detail"] = saved.detail
    return out


def main() -> None:
    out, plans = Path(sys.argv[1]), sys.argv[2:]
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore("tp-act/", store), rank=rank, world_size=world)
    detail = os.environ.get("LLMCTL_TP_ACT_DETAIL") == "1" and rank == 0
    results = {}
    for p in plans:
        try:
            res = measure(p, world, detail)
            every = [None] * world
            dist.all_gather_object(every, res["regions"])
            results[p] = {"ranks": every, **({"detail": res["detail"]} if detail else {})}
        except Exception as e:  # noqa: BLE001 - recorded for the plan's test; build errors are raised on every rank
            results[p] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
