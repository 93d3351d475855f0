"""Run under torchrun: one AdamW step of a small Llama with FSDP2, then report this rank's model-state bytes."""

import json
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def main(precision: str, out: str) -> None:
    dist.init_process_group("gloo")
    cfg = dict(json.loads(sys.argv[3]))
    mt = cfg.pop("model_type")
    config = transformers.AutoConfig.for_model(mt, **cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16-mixed"
        else MixedPrecisionPolicy()
    )
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(
        local_bytes(v) for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"
    )
    steps = sum(local_bytes(st["step"]) for st in opt.state.values())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(
            {"params": params, "grads": grads, "optimizer": states, "step_scalars": steps, "param_dtypes": dtypes}, f
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
