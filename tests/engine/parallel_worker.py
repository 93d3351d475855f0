"""Tensor and context parallelism against data parallelism, in one 4-rank torchrun (`torchrun --nproc_per_node 4
parallel_worker.py OUT.json PLAN [PLAN ...]`): each plan trains 5 steps with the engine's own pieces (meta build, ring
attention, parallelize, materialize, the sequence split, loss, optimizer). A test pairs a reference (FSDP2 over 4
ranks at micro-batch m) with a plan whose tp x cp = k ranks share a micro-batch of k*m sequences: data-parallel rank
d trains on what reference ranks d*k .. d*k+k-1 trained on, so both see the same global batch.

Per plan rank 0 writes {"losses", "grad_norms", "grads", "state_bytes"} (or {"error"}): the mean loss and global
gradient norm of each step, every parameter's whole gradient after the first backward (gathered with full_tensor;
as lists of floats), and this rank's bytes of parameters, gradients and AdamW states after the first step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engine_runs import finish  # this script's folder is on sys.path

from llmctl.engine.context_parallel import SequenceSplit, cp_mesh, install_cpu_ring, use_ring_attention, whole
from llmctl.engine.data import Batch
from llmctl.engine.experts import experts_modules
from llmctl.engine.loss import local_value, model_loss, select_loss
from llmctl.engine.materialize import clean_name
from llmctl.engine.model import Values, base_spec, build_meta_model, materialize, model_spec_for, select_attention
from llmctl.engine.optim import build_optimizer
from llmctl.engine.parallelize import build_mesh, parallelize
from llmctl.engine.scaler import grad_norm
from llmctl.spec.planfile import load_plan

STEPS = 5


def _local_bytes(tensors) -> int:  # noqa: ANN001
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def one_plan(path: str, rank: int, world: int) -> dict:
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
    vocab = base_spec(plan.model).vocab_size
    impl, _ = select_loss(0, False, False, setup.tp)
    optimizer = build_optimizer(model, plan.optimizer, "cpu")
    # The reference's rank r trains on batch r (m sequences); a tp x cp group's data-parallel rank d on batches
    # d*k .. d*k + k - 1 (k = micro-batch / m), the same global batch.
    m = 2
    d = setup.dims.dp_rank(rank)
    k = t.micro_batch_size // m
    parts = [
        torch.randint(0, vocab, (m, t.seq_len + 1), generator=torch.Generator().manual_seed(1000 + d * k + j))
        for j in range(k)
    ]
    ids = torch.cat(parts)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    torch.manual_seed(0)
    losses, norms, grads, state = [], [], {}, None
    for step in range(STEPS):
        with split(Batch(inputs, targets)) as b:
            if impl == "parallel":
                with loss_parallel():
                    loss = model_loss(model, impl, b.inputs, b.targets, vocab, positions=b.positions)
                    loss.backward()
                loss = local_value(loss)
            else:
                loss = model_loss(model, impl, b.inputs, b.targets, vocab, positions=b.positions)
                loss.backward()
        if step == 0:
            for n, p in model.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                if rank == 0:
                    grads[clean_name(n)] = g.detach().float().flatten().tolist()
        norm = grad_norm([p.grad for p in model.parameters() if p.grad is not None])
        if step == 0:
            params = list(model.parameters())
            experts = [p for m in experts_modules(model) for p in m.parameters()]
            state = {
                "parameters": _local_bytes(params),
                "gradients": _local_bytes(p.grad for p in params),
                "expert_parameters": _local_bytes(experts),  # the routed experts' share (expert parallelism)
                "dispatching": sum(getattr(m, "_llmctl_ep", None) is not None for m in experts_modules(model)),
            }
        optimizer.step()
        if step == 0:
            state["optimizer"] = _local_bytes(
                v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim
            )
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        norms.append(float(norm))
    every = [None] * world
    dist.all_gather_object(every, state)
    return {"losses": losses, "grad_norms": norms, "grads": grads, "state_bytes": every}


def ring_probe(rank: int, world: int) -> dict:
    """torch's ring attention on its own, over all ranks as one cp group: SDPA inside the sequence split against
    whole-sequence SDPA (output and q/k/v gradients at this rank's positions), with and without the load balance;
    this rank's positions; and how many times the CPU kernel ran on local blocks (the ring's steps)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from llmctl.engine.context_parallel import _cpu_ops

    fwd, bwd = _cpu_ops()

    def kernel_calls(prof: Any, whole: int) -> dict[str, int]:
        """The CPU kernel's calls on local blocks (the profiler also shows the DTensor-level calls, which carry the
        whole sequence's shape)."""
        names = {"forward": fwd.name(), "backward": bwd.name()}

        def local(e: Any) -> bool:
            return bool(e.input_shapes) and e.input_shapes[0][2] < whole

        return {k: sum(e.name == n and local(e) for e in prof.events()) for k, n in names.items()}

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    install_cpu_ring()
    b, h, kv, s, e = 2, 4, 2, 32, 8
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, n, s, e, generator=gen, requires_grad=True) for n in (h, kv, kv))
    grad = torch.randn(b, h, s, e, generator=gen)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(grad)
    out = {}
    for balance in (True, False):
        ids = torch.arange(s).expand(b, s) * 10  # a token's id says where it came from
        with SequenceSplit(mesh["cp"], balance, "allgather")(Batch(ids, ids + 1)) as part:
            pos = part.positions[0]
            lq, lk, lv = (t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v))
            with torch.profiler.profile(record_shapes=True) as prof:
                got = F.scaled_dot_product_attention(lq, lk, lv, is_causal=True, enable_gqa=True)
                got.backward(grad[:, :, pos])
            diffs = [(got - ref[:, :, pos]).abs().max()] + [
                (a.grad - w.grad[:, :, pos]).abs().max() for a, w in ((lq, q), (lk, k), (lv, v))
            ]
            out["balanced" if balance else "unbalanced"] = {
                "positions": pos.tolist(),
                "ids_match": bool((part.inputs == pos * 10).all() and (part.targets == pos * 10 + 1).all()),
                "max_diff": float(max(diffs)),
                "calls": kernel_calls(prof, s),
            }
    return out


def main() -> None:
    out, plans = Path(sys.argv[1]), sys.argv[2:]
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore("parallel-worker/", store), rank=rank, world_size=world)
    results = {"_ring": ring_probe(rank, world)}
    for p in plans:
        try:
            results[p] = one_plan(p, rank, world)
        except Exception as e:  # noqa: BLE001 - recorded for the plan's test; build errors are raised on every rank
            results[p] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
    every = [None] * world
    dist.all_gather_object(every, results.pop("_ring"))
    if rank == 0:
        out.write_text(json.dumps({**results, "_ring": every}))
    dist.barrier()
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
