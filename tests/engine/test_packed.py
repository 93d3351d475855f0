"""Packed instruction data in the engine (llmctl.engine.data.PackedExamples): targets only where the flags say,
positions restarting at each document, attention that never crosses a document boundary (checked on the model's
outputs), and a step's gradient that is the mean over all its loss tokens, however they fall in micro-batches and
data-parallel ranks."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from llmctl.data.prepare import PrepareConfig, prepare
from llmctl.engine.data import (
    IGNORE,
    PackedExamples,
    RankData,
    build_source,
    build_val_source,
    one_row,
    packed_rows,
)
from llmctl.engine.evaluate import Evaluator
from llmctl.engine.trainer import Trainer
from llmctl.errors import InputError
from llmctl.spec.planfile import DataSection
from tests.family_configs import tiny

S = 64


def chat_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n prompt/response records of varied lengths (plain template, byte tokens: 26 + len(prompt) + len(reply))."""
    rng = np.random.default_rng(seed)
    words = ["rank", "shard", "token", "loss", "mask", "pack", "grad", "step"]
    return [
        {
            "prompt": " ".join(rng.choice(words, int(rng.integers(1, 4)))),
            "response": " ".join(rng.choice(words, int(rng.integers(1, 5)))),
        }
        for _ in range(n)
    ]


def packed_folder(tmp: Path, n: int = 120, val_fraction: float = 0.1, seq_len: int = S) -> Path:
    src = tmp / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in chat_records(n)))
    out = tmp / "packed"
    prepare(PrepareConfig((str(src),), out, seq_len=seq_len, val_fraction=val_fraction, instruction=True, workers=1))
    return out


def test_targets_and_positions_of_hand_made_packs() -> None:
    # one pack of 8: a document of 3 (loss on its last 2), one of 3 (loss on its last token), 2 of padding
    tokens = np.array([[10, 11, 12, 20, 21, 22, 0, 0]])
    flags = np.array([[2, 1, 1, 2 | 1, 0, 1, 2, 0]], dtype=np.uint8)  # a loss bit on a document start never counts
    inputs, targets, positions = packed_rows(tokens, flags)
    assert inputs.tolist() == tokens.tolist()
    assert targets.tolist() == [[11, 12, IGNORE, IGNORE, 22, IGNORE, IGNORE, IGNORE]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]


def test_a_packed_folder_is_read_as_packed_examples(tmp_path: Path) -> None:
    folder = packed_folder(tmp_path)
    data = DataSection(kind="tokens", paths=[str(folder)], val="split")
    blocks, desc = build_source(data, S, 0, 320)
    assert isinstance(blocks, PackedExamples) and "examples packed in" in desc and "loss tokens" in desc
    assert blocks.num_blocks == len(blocks.tokens) // S
    meta = json.loads((folder / "meta.json").read_text())
    assert blocks.loss_token_fraction == meta["splits"]["train"]["packed"]["loss_tokens"] / len(blocks.tokens)
    val, _ = build_val_source(data, S, 320)
    assert isinstance(val, PackedExamples) and not val.shuffle
    # every loss token of the split is a target exactly once (inputs[j] -> targets[j] predicts token j+1)
    b = blocks.batch(0, blocks.num_blocks)
    assert int((b.targets != IGNORE).sum()) == meta["splits"]["train"]["packed"]["loss_tokens"]
    assert b.inputs.shape == b.targets.shape == b.positions.shape == (blocks.num_blocks, S)
    assert (b.targets[:, -1] == IGNORE).all() and (b.positions[:, 0] == 0).all()
    with pytest.raises(InputError, match=r"packs of 64 tokens, but training.seq_len is 32 \(set training.seq_len: 64"):
        build_source(data, 32, 0, 320)
    with pytest.raises(InputError, match=r"context parallelism \(cp 2\).*\(set parallel.cp: 1\)"):
        build_source(data, S, 0, 320, cp=2)


def test_rank_batches_carry_the_global_loss_token_count(tmp_path: Path) -> None:
    blocks, _ = build_source(DataSection(kind="tokens", paths=[str(packed_folder(tmp_path))]), S, 0, 320)
    ranks = [RankData(blocks, 2, 2, r, 2) for r in range(2)]
    step = 1
    batches = [b for r in ranks for b in r.micro_batches(step)]
    total = sum(int((b.targets != IGNORE).sum()) for b in batches)  # the step's global batch: 2 ranks x 2 x 2
    assert all(b.loss_divisor == total / 2 for b in batches)
    assert ranks[0].step_fields(step) == {"loss_token_fraction": total / (8 * S)}
    assert ranks[0].step_loss_tokens(step) == total


def test_the_evaluator_pads_packed_batches_with_ignored_targets(tmp_path: Path) -> None:
    folder = packed_folder(tmp_path, val_fraction=0.2)
    val, _ = build_val_source(DataSection(kind="tokens", paths=[str(folder)], val="split"), S, 320)
    ev = Evaluator(val, 2, 1, 0, 1, eval_batches=val.num_blocks)  # asks for 2 x blocks: the second half padding
    mbs = ev.micro_batches()
    real = sum(int((b.targets != IGNORE).sum()) for b in mbs)
    assert real == int((val.batch(0, val.num_blocks).targets != IGNORE).sum())
    assert all(b.positions is not None and b.positions.shape == b.inputs.shape for b in mbs)


def tiny_llama(attention: str) -> torch.nn.Module:
    import transformers

    cfg = tiny("llama")
    # use_cache off, as the engine builds its models (llmctl.engine.model): transformers reads packed sequences from
    # the positions only without a cache (masking_utils._preprocess_mask_arguments)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    return model.eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_no_token_attends_across_a_document_boundary(attention: str) -> None:
    """Documents A (11 tokens), B (7) and padding (6) in one pack of 24, positions restarting at each: the logits of
    A and of B equal those of each run alone (transformers builds the block-causal mask from the positions:
    masking_utils.find_packed_sequence_indices). With positions 0..23 (no restart) B's logits differ: the check
    can fail."""
    model = tiny_llama(attention)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 256, (1, 11), generator=g), torch.randint(0, 256, (1, 7), generator=g)
    pack = torch.cat([a, b, torch.full((1, 6), 257)], dim=1)
    positions = torch.cat([torch.arange(11), torch.arange(7), torch.arange(6)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(input_ids=pack, position_ids=positions).logits
        alone_a = model(input_ids=a).logits
        alone_b = model(input_ids=b).logits
        unmasked = model(input_ids=pack, position_ids=torch.arange(24).unsqueeze(0)).logits
    diff_a = (packed[:, :11] - alone_a).abs().max().item()
    diff_b = (packed[:, 11:18] - alone_b).abs().max().item()
    assert diff_a < 1e-5 and diff_b < 1e-5, (diff_a, diff_b)
    assert (unmasked[:, 11:18] - alone_b).abs().max().item() > 1e-2


def test_one_row_keeps_the_documents_for_flash_attention(tmp_path: Path) -> None:
    """flash-attention 2 reads packed documents from the positions only for a batch of one row (transformers'
    _is_packed_sequence), so a packed micro-batch goes to it as one row: the same logits as the rows (sdpa here)."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    blocks, _ = build_source(DataSection(kind="tokens", paths=[str(packed_folder(tmp_path))]), S, 0, 320)
    b = blocks.batch(0, 3)
    row = one_row(b)
    assert row.inputs.shape == (1, 3 * S) and (row.targets.reshape(3, S) == b.targets).all()
    assert _is_packed_sequence(row.positions, 1) and not _is_packed_sequence(b.positions, 3)
    model = tiny_llama("sdpa")
    with torch.no_grad():
        rows = model(input_ids=b.inputs, position_ids=b.positions).logits
        one = model(input_ids=row.inputs, position_ids=row.positions).logits
    assert (one.reshape(rows.shape) - rows).abs().max().item() < 1e-5


def fake_trainer(model: torch.nn.Module, acc: int) -> types.SimpleNamespace:
    """What Trainer.forward_backward reads of its trainer: one process, the whole loss, no scaling."""
    from llmctl.engine.context_parallel import whole

    return types.SimpleNamespace(
        setup_=types.SimpleNamespace(grad_accum_steps=acc),
        split=whole,
        loss_impl="whole",
        attn_impl="sdpa",
        model=model,
        vocab=300,
        phase_peaks=types.SimpleNamespace(mark=lambda _: None),
        watch=types.SimpleNamespace(beat=lambda *_: None, data=lambda *_: None),
        grad_step=types.SimpleNamespace(loss_multiplier=1.0),
        aux=None,  # no MoE load-balancing term
    )


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_a_step_gradient_is_the_mean_over_all_its_loss_tokens(tmp_path: Path) -> None:
    """Step 0 of 2 dp ranks x 2 micro-batches of 1 pack (unequal loss-token counts), each rank's gradients summed by
    Trainer.forward_backward and the ranks' averaged (FSDP2's reduce-scatter averages over the dp ranks) equals the
    gradient of the mean loss over every loss token of the 4 packs, computed at once in one process. A mean per
    micro-batch, or a divisor that forgets dp, fails it; so does the reported loss."""
    blocks, _ = build_source(DataSection(kind="tokens", paths=[str(packed_folder(tmp_path))]), S, 0, 320)
    model = tiny_llama("sdpa").float()
    dp, acc = 2, 2
    per_rank, reported = [], 0.0
    counts = []
    for r in range(dp):
        model.zero_grad(set_to_none=True)
        for b in RankData(blocks, 1, acc, r, dp).micro_batches(0):
            counts.append(int((b.targets != IGNORE).sum()))
            reported += Trainer.forward_backward(fake_trainer(model, acc), b).item()
        per_rank.append(grads(model))
    assert len(set(counts)) > 1, counts  # the micro-batches differ in loss tokens: a per-micro-batch mean differs
    averaged = sum(per_rank) / dp
    model.zero_grad(set_to_none=True)
    whole = blocks.batch(0, dp * acc)
    logits = model(input_ids=whole.inputs, position_ids=whole.positions).logits
    ref = torch.nn.functional.cross_entropy(logits[..., :300].float().reshape(-1, 300), whole.targets.reshape(-1))
    ref.backward()
    expected = grads(model)
    assert torch.allclose(averaged, expected, rtol=1e-4, atol=1e-7), (averaged - expected).abs().max()
    assert reported / (acc * dp) == pytest.approx(ref.item(), rel=1e-5)  # log_step's mean over micro-batches, ranks


def test_the_chunked_loss_mean_is_over_the_real_targets() -> None:
    from llmctl.engine.loss import chunked_loss

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, generator=g), torch.randn(20, 8, generator=g)
    targets = torch.randint(0, 20, (2, 6), generator=g)
    targets[0, :4] = IGNORE
    got = chunked_loss(hidden, weight, None, targets, 20, chunk_tokens=5)
    want = torch.nn.functional.cross_entropy((hidden @ weight.T).reshape(-1, 20), targets.reshape(-1))
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
