"""Materialize a plan's model as rank R of a world of W under a fake process group and save that rank's local
shards (`python shard_worker.py PLAN OUT.pt W R`).

The rank is set up exactly as the engine does (meta build, parallelize, materialize), so a test can put every
rank's shard side by side with a one-process model. One process per rank: DeviceMesh caches its sub-meshes by
shape and names, so a second rank played in the same process would reuse the first one's mesh coordinates.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from llmctl.engine.materialize import WeightFiles, slots
from llmctl.engine.model import Values, base_spec, build_meta_model, materialize, model_spec_for
from llmctl.engine.parallelize import build_mesh, parallelize
from llmctl.spec.planfile import load_plan


def main() -> None:
    plan_path, out, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    plan = load_plan(plan_path)
    weights = WeightFiles.scan(plan.model.weights) if plan.model.weights else None
    result = {}
    for rank in map(int, sys.argv[4:5]):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        mesh = build_mesh(plan.setup.dims, "cpu")
        model = build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")
        parallelize(model, model_spec_for(plan.model), plan.setup, mesh)
        materialize(
            model,
            plan.setup,
            torch.device("cpu"),
            Values(plan.training.seed, base_spec(plan.model).vocab_size, weights),
        )
        result[rank] = {
            s.name: {"offset": s.offset, "rows": s.rows, "local": s.local.clone(), "names": s.names}
            for s in slots(model)
        }
        result[rank]["__buffers__"] = {n: b.clone() for n, b in model.named_buffers()}
        dist.destroy_process_group()
    torch.save(result, out)


if __name__ == "__main__":
    main()
