"""Train several plans in one torchrun, 3 steps each, with the engine's own pieces (`torchrun --nproc_per_node 2
family_worker.py OUT.json PLAN... [--engine PLAN...]`): the engine's meta build, parallelize (checkpointing -> FSDP2
per block), materialize, loss and optimizer, one after the other in one process group. Starting a torchrun costs
~10 s of CPU on the test machine (torch and transformers imported by the agent and each rank), a plan here well
under a second. The plans after --engine then run, in the same launch, through the engine's entry point with its
own training loop (engine_runs.py: a new process group per plan, since the loop destroys its group at its end);
their results ({"code", "log"}) are added to OUT.json.

Per plan, rank 0 writes {"losses", "grad_norms", "attention", "init_equal"} (or {"error"}): the mean loss over ranks and the global
gradient norm of each step on a fixed batch (each rank's own 2 x 32 random tokens, the same at every step), the
attention kernel the model was built with, and whether the sharded initial parameters equal the one-process model's
(every FSDP2 shard gathered with full_tensor), buffers included.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_runs import finish, run_plans  # this script's folder is on sys.path

from llmctl.engine.loss import install_loss_forward, select_loss, whole_loss
from llmctl.engine.materialize import clean_name
from llmctl.engine.model import Values, base_spec, build_meta_model, materialize, model_spec_for, select_attention
from llmctl.engine.optim import build_optimizer
from llmctl.engine.parallelize import build_mesh, parallelize
from llmctl.spec.planfile import load_plan


def one_plan(path: str, rank: int, world: int) -> dict:
    plan = load_plan(path)
    t = plan.training
    attn, _ = select_attention(t.attention, False, False)
    mesh = build_mesh(plan.setup.dims, "cpu")
    model = build_meta_model(model_spec_for(plan.model), plan.setup, attn)
    parallelize(model, model_spec_for(plan.model), plan.setup, mesh)
    materialize(model, plan.setup, torch.device("cpu"), Values(plan.training.seed, base_spec(plan.model).vocab_size))
    # full_tensor is a collective: every rank gathers, rank 0 compares with the model materialized in one process.
    full = {
        clean_name(n): p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()
    }
    buffers = {clean_name(n): b for n, b in model.named_buffers()}
    init_equal = None
    if rank == 0:
        ref = build_meta_model(model_spec_for(plan.model), plan.setup, attn)
        materialize(ref, plan.setup, torch.device("cpu"), Values(plan.training.seed, base_spec(plan.model).vocab_size))
        init_equal = all(torch.equal(full[n], p.detach()) for n, p in ref.named_parameters()) and all(
            torch.equal(buffers[n], b) for n, b in ref.named_buffers()
        )
    vocab = base_spec(plan.model).vocab_size
    impl, _ = select_loss(t.loss_chunk_tokens, False, False)
    if impl != "whole":
        install_loss_forward(model, impl, vocab, t.loss_chunk_tokens)
    optimizer = build_optimizer(model, plan.optimizer, "cpu")
    ids = torch.randint(0, vocab, (t.micro_batch_size, t.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    # Dropout (GPT-2's default 0.1) draws from the global generator: every plan starts it from the same state, so
    # a checkpointed run draws the plain run's masks whatever plans ran before it in this process.
    torch.manual_seed(rank)
    losses, norms = [], []
    for _ in range(plan.total_steps):
        loss = whole_loss(model, inputs, targets, vocab) if impl == "whole" else model(input_ids=inputs, labels=targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return {
        "losses": losses,
        "grad_norms": norms,
        "attention": model.config._attn_implementation,
        "init_equal": init_equal,
    }


def main() -> None:
    args = sys.argv[1:]
    cut = args.index("--engine") if "--engine" in args else len(args)
    out, plans, engine_plans = Path(args[0]), args[1:cut], args[cut + 1 :]
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore("family-worker/", store), rank=rank, world_size=world)
    results = {}
    for p in plans:
        try:
            results[p] = one_plan(p, rank, world)
        except Exception as e:  # noqa: BLE001 - recorded for the plan's test; the others still run. Build and
            # sharding errors are raised on every rank alike, before any collective, so the ranks stay in step.
            results[p] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()  # leave together (a peer's last collective still in flight can abort gloo's teardown)
    dist.destroy_process_group()
    run_plans(engine_plans, store, rank, world, out)
    # The results are written: skip the interpreter's teardown, where gloo's C++ objects are destroyed in no fixed
    # order and a rank now and then aborts ("terminate called without an active exception", SIGABRT) after a run
    # that succeeded; that exit is the engine's concern (its CLI tests see it), not what this harness measures.
    finish(0)


if __name__ == "__main__":
    main()
