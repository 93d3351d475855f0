"""FSDP2's units as torchtitan sets them (issue 47): the embeddings alone, the final norm + LM head together, then the
root; tied embeddings stay in the root. What a unit holds between forward and backward is the point: the embeddings'
gathered copy is freed after their forward (it was held until the end of backward in the root), the norm + head stay
gathered into backward, where they are needed first. Checked on the registered parameters (FSDP2 swaps a sharded
DTensor for the gathered tensor and back), in a world of one (bf16 keeps FSDP2 on: llmctl.engine.parallelize.needs_fsdp)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM
from llmctl.engine.parallelize import apply_fsdp

tied = sys.argv[1] == "tied"
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=2, vocab_size=96, tie_word_embeddings=tied)
model = AutoModelForCausalLM.from_config(cfg)
apply_fsdp(model, init_device_mesh("cpu", (1,)), "bf16")
emb, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
seen = {}

def gathered(m):
    return not isinstance(m.weight, DTensor)

def probe(name):
    def hook(*_):
        seen[name] = {"embeddings": gathered(emb), "head": gathered(head), "norm": gathered(norm)}
    return hook

model.model.layers[1].register_forward_hook(probe("end of forward"))
head.register_full_backward_hook(probe("head backward"))
loss = model(torch.randint(0, 96, (2, 16)), labels=torch.randint(0, 96, (2, 16))).loss
seen["after forward"] = {"embeddings": gathered(emb), "head": gathered(head), "norm": gathered(norm)}
loss.backward()
units = {n: isinstance(m, FSDPModule) for n, m in (("embeddings", emb), ("norm", norm), ("head", head))}
print(json.dumps({"units": units, "seen": seen}))
"""


def _run(kind: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, kind], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_embeddings_and_head_are_units_of_their_own_unless_tied(kind: str) -> None:
    got = _run(kind)
    if kind == "tied":  # one parameter in two places: the root holds both, gathered from forward to backward
        assert got["units"] == {"embeddings": False, "norm": False, "head": False}
        assert got["seen"]["end of forward"]["embeddings"] and got["seen"]["after forward"]["embeddings"]
        return
    assert got["units"] == {"embeddings": True, "norm": True, "head": True}
    # the embeddings' gathered copy is gone once their forward ran; the norm + head are gathered when needed ...
    assert got["seen"]["end of forward"] == {"embeddings": False, "head": False, "norm": False}
    # ... and stay gathered from the end of forward into their backward (reshard_after_forward False)
    assert got["seen"]["after forward"] == {"embeddings": False, "head": True, "norm": True}
    assert got["seen"]["head backward"]["head"] and not got["seen"]["head backward"]["embeddings"]


def test_the_memory_model_holds_what_the_units_hold() -> None:
    """Untied (Llama 3.1 8B): the final norm + LM head between forward and backward, not the embeddings (freed after
    their forward); tied (Llama 3.2 1B): the whole root, as before. Per rank of tp 2 the head's vocabulary half."""
    from llmctl.plan import memory as mem
    from llmctl.spec import models
    from llmctl.spec.setup import TrainSetup

    def held(name: str, **kw: int) -> dict[str, int]:
        est = mem.estimate(models.resolve_model(name), TrainSetup(precision="bf16-mixed", gpus_per_node=8, **kw))
        return {c.name: c.bytes for c in est.components if c.name.startswith("unsharded") and "layer" not in c.name}

    big = models.resolve_model("llama-3.1-8b")
    assert not big.tie_embeddings
    assert held("llama-3.1-8b") == {"unsharded final norm + LM head": 2 * big.head_params}
    assert big.head_params == big.vocab_size * big.hidden_size + big.hidden_size  # the head and the norm, no embedding
    assert held("llama-3.1-8b", tp=2) == {"unsharded final norm + LM head": big.head_params}
    small = models.resolve_model("llama-3.2-1b")
    assert small.tie_embeddings
    assert held("llama-3.2-1b") == {
        "unsharded root module (embeddings, LM head)": 2 * (small.embedding_params + small.head_params)
    }
