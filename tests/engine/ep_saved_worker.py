"""Measures what one MoE layer's routed experts save for backward (llmctl.measure.saved) on one process: the engine's
dispatching forward (llmctl.engine.experts.dispatch_forward over an ep group of one rank, gloo) and transformers'
own experts forward (the ep 1 path), for each MoE family's tiny config in fp32 and bf16. Prints one JSON list of
{"family", "dtype", "tokens", "dispatch", "loop"} (bytes). Run by tests/engine/test_ep_activations.py."""

from __future__ import annotations

import json
import socket
import types

import torch
import torch.distributed as dist
import transformers

from llmctl.engine.experts import ExpertGroup, dispatch_forward, experts_modules
from llmctl.measure.saved import SavedBytes
from tests.family_configs import tiny

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
TOKENS = 24


def saved(module: torch.nn.Module, exclude: list[torch.Tensor], *args: torch.Tensor) -> int:
    with SavedBytes(exclude=exclude) as sb:
        out = module(*args)
    total = sb.total()  # while `out` holds the graph (the saved storages die with it)
    del out
    return total


def measure(family: str, dtype: torch.dtype) -> dict:
    cfg = tiny(family)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    m = experts_modules(model)[0]
    k, h = config.num_experts_per_tok, config.hidden_size
    hs = torch.randn(TOKENS, h, dtype=dtype, requires_grad=True)
    idx = torch.stack([torch.randperm(m.num_experts)[:k] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, k, dtype=dtype, requires_grad=True)
    exclude = [*model.parameters(), hs]
    loop = saved(m, exclude, hs, idx, weights)
    m._llmctl_ep = ExpertGroup(dist.group.WORLD, 1, 0, None)
    m.forward = types.MethodType(dispatch_forward, m)
    dispatch = saved(m, exclude, hs, idx, weights)
    return {"family": family, "dtype": str(dtype), "tokens": TOKENS, "dispatch": dispatch, "loop": loop}


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        out = [measure(f, d) for f in FAMILIES for d in (torch.float32, torch.bfloat16)]
    finally:
        dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
