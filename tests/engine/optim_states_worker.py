"""Run in a process of its own (process groups one after the other): what the optimizers for `optimizer.states`
allocate and what torch.distributed.checkpoint gives back. `worker JOBS_JSON DIR` prints one JSON object of both:

    alloc                      for each [config, world, ranks] of JOBS_JSON, each of those ranks (a fake process
                               group: no collectives run): the model of `config` on the meta device, FSDP2 per block
                               and at the root, zero gradients, one AdamW8bit step; the bytes of its moments (codes,
                               scales, code books), as "job.world.rank"
    dcp                        gloo, world 1, in DIR, for bf16 and 8bit states: a small model under FSDP2, two steps,
                               get_state_dict + dcp.save, a fresh model and optimizer, dcp.load + set_state_dict; the
                               states' kinds and dtypes, and whether every state came back equal
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from llmctl.engine.adamw_states import MomentsAdamW, adamw_8bit


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def moment_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if k == "step":
                continue
            t = local(v)
            total += t.codes.nbytes + t.scale.nbytes + t.qmap.nbytes if hasattr(t, "codes") else t.nbytes
    return total


def alloc(jobs: list) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = {}
    for job, (config, world, ranks) in enumerate(jobs):
        cfg = transformers.AutoConfig.for_model(**config)
        for rank in ranks:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                mesh = init_device_mesh("cpu", (world,))
                with torch.device("meta"):
                    model = transformers.AutoModelForCausalLM.from_config(cfg)
                for layer in model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
                opt = adamw_8bit([{"params": list(model.parameters())}], lr=1e-3)
                opt.step()
                out[f"{job}.{world}.{rank}"] = moment_bytes(opt)
            finally:
                dist.destroy_process_group()
    return out


def make(states: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    groups = [{"params": list(model.parameters())}]
    if states == "8bit":
        return model, adamw_8bit(groups, lr=1e-2)
    return model, MomentsAdamW(groups, lr=1e-2, moments_dtype=torch.bfloat16)


def dcp_round_trips(folder: str) -> dict:
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    try:
        return {states: dcp_round_trip(states, Path(folder) / states) for states in ("bf16", "8bit")}
    finally:
        dist.destroy_process_group()


def dcp_round_trip(states: str, folder: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = make(states)
    for i in range(2):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i))
        (model(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    model2, opt2 = make(states)
    model_sd2, optim_sd2 = get_state_dict(model2, opt2)
    state = {"model": model_sd2, "optim": optim_sd2}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    equal, kinds = True, set()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        equal &= torch.equal(local(p1), local(p2))
        for k, a in opt.state[p1].items():
            a, b = local(a), local(opt2.state[p2][k])
            kinds.add(f"{k}:{type(b).__name__}:{b.dtype}")
            if hasattr(a, "codes"):
                equal &= torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
            else:
                equal &= a.dtype == b.dtype and torch.equal(a, b)
    return {"equal": bool(equal), "kinds": sorted(kinds)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    result = {"alloc": alloc(json.loads(sys.argv[1])), "dcp": dcp_round_trips(sys.argv[2])}
    print("RESULT " + json.dumps(result))
