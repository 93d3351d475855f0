"""QLoRA's NF4 base in one process (llmctl.engine.qlora, llmctl.spec.nf4): which weights go to NF4 and at which scale
block, each rank's piece (the whole tensor quantized once, its rows in storage of their own), the sizes the memory
model uses, and the one-line refusals. The sharded runs are in tests/engine/test_weights_round_trip.py."""

from __future__ import annotations

import pytest
import torch

from llmctl.engine import qlora
from llmctl.engine.materialize import held_bytes, storage_key
from llmctl.errors import SpecError
from llmctl.spec import nf4

NF4 = qlora.nf4_module()


@pytest.mark.parametrize(
    ("shape", "shard", "want"),
    [
        ((4096, 4096), 8, 256),  # a real projection: the paper's scale block
        ((1024, 4096), 512, 128),  # 65,536 blocks over 512 ranks: 128 each
        ((688, 256), 2, 32),  # llama-tiny's MLP: 2,752 blocks = 2 x 32 x 43
        ((172, 64), 4, 1),  # the engine tests' MLP: 172 blocks, 43 per rank
        ((8, 4096), 16, None),  # a Mixtral router over 16 ranks: 8 rows cannot be cut 16 ways
        ((3, 7), 1, None),  # not a whole block of 64
    ],
)
def test_scale_block_is_the_largest_that_every_piece_holds_whole(shape, shard, want) -> None:
    assert nf4.scaler_block(shape, shard) == want
    if want is not None:  # and torchao agrees: the weight quantizes and splits into `shard` pieces of whole blocks
        q = NF4.to_nf4(torch.randn(shape, dtype=torch.bfloat16), 64, want)
        assert len(torch.split(q, shape[0] // shard, dim=0)) == shard


def test_a_piece_is_the_whole_tensors_quantization_in_its_own_storage() -> None:
    """Quantizing each piece alone would give it its own absmax mean, and FSDP2 rebuilds the gathered weight with
    the local piece's mean: the pieces must come from one quantization. A view would keep all of it alive."""
    w = torch.randn(256, 128, dtype=torch.bfloat16) * torch.linspace(0.1, 3, 256, dtype=torch.bfloat16)[:, None]
    q = NF4.to_nf4(w, 64, nf4.scaler_block(tuple(w.shape), 4))
    whole = q.get_original_weight()
    pieces = [qlora.own_rows(q, 64, i) for i in range(4)]
    for i, p in enumerate(pieces):
        assert torch.equal(p.get_original_weight(), whole[64 * i : 64 * (i + 1)])
        assert torch.equal(p.scaler_mean, q.scaler_mean)
        data = p.quantized_data
        assert data.untyped_storage().nbytes() == data.numel() == 64 * 128 // 2  # its own rows only
    alone = NF4.to_nf4(w[64:128].contiguous(), 64, nf4.scaler_block((64, 128), 1)).scaler_mean
    assert not torch.equal(alone, q.scaler_mean)  # the mutant "quantize each shard" is visible here
    assert (whole.float() - w.float()).abs().max() < 0.2 * w.float().abs().max()  # NF4 is a 4-bit copy of w


def test_held_bytes_and_the_memory_model_agree_per_piece() -> None:
    shape, shard = (172, 64), 4
    q = NF4.to_nf4(torch.randn(shape, dtype=torch.bfloat16), 64, nf4.scaler_block(shape, shard))
    pieces = [qlora.own_rows(q, 43, i) for i in range(shard)]
    assert sum(held_bytes(p) for p in pieces) == nf4.nf4_bytes(shape, shard, 2)
    assert held_bytes(torch.zeros(3, 5, dtype=torch.bfloat16)) == 30
    assert storage_key(torch.nn.Parameter(pieces[0], requires_grad=False)) is None  # no one storage: never drawn
    big = nf4.nf4_bytes((4096, 4096), 8, 2) / 4096**2
    assert big == pytest.approx(nf4.BYTES_PER_WEIGHT_BF16, rel=1e-4) and 4.12 < 8 * big < 4.13  # bits per weight


def _meta_model(preset: str = "llama-tiny", method: str = "qlora"):
    from llmctl.engine.model import build_meta_model, model_spec_for
    from llmctl.spec.planfile import plan_from_dict

    doc = {
        "model": {"preset": preset, "overrides": {"num_hidden_layers": 2}},
        "training": {"max_steps": 1, "seq_len": 32, "precision": "bf16-mixed"},
        "finetune": {"method": method, "lora_rank": 4},
    }
    plan = plan_from_dict(doc)
    return build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")


def test_the_targets_are_every_frozen_block_linear_and_gpt2_is_refused() -> None:
    model = _meta_model()
    found = qlora.targets(model)
    names = {n.split(": ")[1] for n, _ in found}
    assert "self_attn.q_proj.base_layer" in names and "mlp.down_proj.base_layer" in names
    assert not [n for n in names if "lora_" in n]  # the adapters train: never quantized
    assert all(not m.weight.requires_grad and m.weight.ndim == 2 for _, m in found)
    qlora.placeholders(model)
    w = found[0][1].weight
    assert qlora.is_nf4(w) and w.device.type == "meta" and w._is_hf_initialized
    # A GPT-2 preset is refused when the plan is read (llmctl.spec.rules); a model from a config or weights folder,
    # which the plan cannot read, by the engine's own check of what it built.
    with pytest.raises(SpecError, match="finetune.method: .*Conv1D layers.*--finetune lora"):
        _meta_model("gpt2-tiny")
    with pytest.raises(SpecError, match="Conv1D layers.*finetune.method lora"):
        qlora.targets(_meta_model("gpt2-tiny", method="lora"))


def test_weights_that_cannot_be_sharded_stay_bf16_and_none_at_all_is_one_line(caplog) -> None:
    class Fake:
        def __init__(self, shape):
            self.weight = torch.empty(shape, device="meta")

    ok, odd = ("a", Fake((64, 64))), ("router", Fake((3, 7)))
    assert qlora.split_targets([ok, odd]) == [ok]
    assert "kept in the compute dtype" in caplog.text and "router [3, 7]" in caplog.text
    with pytest.raises(SpecError, match="no block linear of this model can be split into NF4"):
        qlora.split_targets([odd])


def test_a_random_base_is_the_nf4_of_the_lora_base_of_the_same_seed() -> None:
    """Random init (no weights folder), a world of one: each NF4 weight is the model's own init drawn under the
    frozen linear's Hugging Face name, as the bf16 path draws it, then quantized. A mutant that draws under peft's
    `base_layer` name (another seed) or skips the init (zeros) is far from the LoRA base."""
    from llmctl.engine.model import Values, base_spec, build_meta_model, materialize, model_spec_for
    from llmctl.spec.planfile import plan_from_dict

    def built(method: str):
        doc = {
            "model": {"preset": "llama-tiny", "overrides": {"num_hidden_layers": 1}},
            "training": {"max_steps": 1, "seq_len": 32, "precision": "bf16", "seed": 7},
            "finetune": {"method": method, "lora_rank": 4},
        }
        plan = plan_from_dict(doc)
        model = build_meta_model(model_spec_for(plan.model), plan.setup, "sdpa")
        made = materialize(
            model, plan.setup, torch.device("cpu"), Values(plan.training.seed, base_spec(plan.model).vocab_size)
        )
        return model, made

    q, made = built("qlora")
    b, _ = built("lora")
    assert "7 linears (" in made.source and "in NF4" in made.source
    name = "model.layers.0.mlp.down_proj.base_layer.weight"
    qw, bw = q.get_parameter(name), b.get_parameter(name)
    assert qlora.is_nf4(qw) and not qlora.is_nf4(bw) and qw.device.type == "cpu"
    want = NF4.to_nf4(bw.detach(), 64, nf4.scaler_block(tuple(bw.shape), 1)).get_original_weight()
    assert torch.equal(qw.get_original_weight(), want)
    assert bw.float().std() > 0.01  # the init drew (std 0.02), not zeros
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(q.get_parameter(norm), b.get_parameter(norm))  # the rest of the base: as LoRA's


def test_an_unreadable_weights_file_is_one_line(tmp_path) -> None:
    """A block linear is read whole from model.weights to be quantized: a damaged file is one SpecError line naming
    it (exit 2), as the rest of the base's loading says it, not a safetensors traceback."""
    from pathlib import Path

    from llmctl.engine.materialize import WeightFiles

    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    name = "model.layers.0.mlp.down_proj.weight"
    files = WeightFiles(Path(tmp_path), {name: bad})
    module = torch.nn.Linear(4, 4)
    with pytest.raises(SpecError, match=r"model.weights: cannot read .*model.safetensors: \w+"):
        qlora._full_values(name, module, None, files, (), 0)
