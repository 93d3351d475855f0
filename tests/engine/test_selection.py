"""Pure selection logic of the engine: device/backend, attention kernel, vocabulary padding, mesh, LR schedule."""

from __future__ import annotations

import pytest

from llmctl.engine.model import model_spec_for, padded_vocab_size, select_attention, select_device, torch_dtype
from llmctl.engine.optim import lr_factor
from llmctl.engine.parallelize import check_world
from llmctl.errors import InputError
from llmctl.spec.planfile import plan_from_dict


def plan(**sections):
    base = {"model": {"preset": "llama-tiny"}, "training": {"max_steps": 1}}
    base.update(sections)
    return plan_from_dict(base)


def test_device_follows_the_machine() -> None:
    assert select_device(True, 3) == select_device(True, 3)
    assert select_device(True, 3).device == "cuda:3" and select_device(True, 3).backend == "nccl"
    assert select_device(False, 3).device == "cpu" and select_device(False, 3).backend == "gloo"


@pytest.mark.parametrize(
    ("requested", "cuda", "flash", "expected"),
    [
        ("auto", True, True, "flash_attention_2"),
        ("auto", True, False, "sdpa"),
        ("auto", False, True, "sdpa"),
        ("auto", False, False, "sdpa"),
        ("flash", True, True, "flash_attention_2"),
        ("sdpa", True, True, "sdpa"),
        ("eager", False, False, "eager"),
    ],
)
def test_attention_selection(requested: str, cuda: bool, flash: bool, expected: str) -> None:
    impl, why = select_attention(requested, cuda, flash)
    assert impl == expected and why


@pytest.mark.parametrize(("cuda", "flash", "needle"), [(False, True, "CUDA"), (True, False, "flash-attn")])
def test_flash_where_it_cannot_run_fails_fast(cuda: bool, flash: bool, needle: str) -> None:
    with pytest.raises(InputError) as e:
        select_attention("flash", cuda, flash)
    assert needle in str(e.value) and "\n" not in str(e.value) and e.value.exit_code == 2


def test_auto_logs_why() -> None:
    assert "no CUDA" in select_attention("auto", False, True)[1]
    assert "flash-attn not installed" in select_attention("auto", True, False)[1]


@pytest.mark.parametrize(
    ("vocab", "multiple", "padded"),
    [(258, 64, 320), (320, 64, 320), (32000, 64, 32000), (50257, 64, 50304), (128256, 64, 128256), (7, 1, 7)],
)
def test_vocab_padding(vocab: int, multiple: int, padded: int) -> None:
    assert padded_vocab_size(vocab, multiple) == padded


def test_model_spec_pads_vocab_and_applies_overrides() -> None:
    p = plan(model={"preset": "gpt2-tiny", "overrides": {"vocab_size": 300, "n_layer": 2}})
    spec = model_spec_for(p.model)
    assert spec.vocab_size == 320 and spec.num_layers == 2


def test_precision_to_peak_dtype() -> None:
    assert str(torch_dtype("bf16")) == "torch.bfloat16" and str(torch_dtype("fp32")) == "torch.float32"


@pytest.mark.parametrize(
    ("parallel", "hardware", "shape", "names"),
    [
        ({"sharding": "full"}, {"nproc_per_node": 4}, (4,), ("shard",)),
        ({"sharding": "hybrid"}, {"nodes": 2, "nproc_per_node": 2}, (2, 2), ("replicate", "shard")),
        ({"sharding": "hybrid", "shard_size": 4}, {"nodes": 2, "nproc_per_node": 4}, (2, 4), ("replicate", "shard")),
        ({"sharding": "no_shard"}, {"nproc_per_node": 4}, (4, 1), ("replicate", "shard")),
        ({"sharding": "full", "tp": 2}, {"nproc_per_node": 8}, (4, 2), ("shard", "tp")),
        ({"sharding": "hybrid", "tp": 4}, {"nodes": 2, "nproc_per_node": 8}, (2, 2, 4), ("replicate", "shard", "tp")),
    ],
)
def test_mesh_per_strategy(parallel: dict, hardware: dict, shape: tuple, names: tuple) -> None:
    p = plan(parallel=parallel, hardware=hardware)
    check_world(p.hardware, p.world_size)
    assert p.setup.dims.mesh_dims == (shape, names)


def test_world_size_mismatch_is_one_clear_line() -> None:
    p = plan(hardware={"nproc_per_node": 2})
    with pytest.raises(InputError, match="plan is for 2 ranks .* but 1 were started"):
        check_world(p.hardware, 1)


def test_lr_warmup_then_cosine_to_floor() -> None:
    f = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert all(a >= b for a, b in zip(f[10:], f[11:], strict=False))
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(0, 5, 0, 0.0) == pytest.approx(1.0)


def test_mixed_precision_policy() -> None:
    import torch

    from llmctl.engine.parallelize import mixed_precision

    mp = mixed_precision("bf16-mixed")
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32
    assert mixed_precision("fp32") is None
    mp = mixed_precision("fp16")  # fp16 copies of fp32 masters, gradients reduced in fp32 (the loss scaler's check)
    assert mp.param_dtype == torch.float16 and mp.reduce_dtype == torch.float32
    mp = mixed_precision("fp8")  # float8 is per linear layer (torchao); FSDP2 gathers bf16 for the rest
    assert mp.param_dtype == torch.bfloat16 and mp.reduce_dtype == torch.float32


def test_prefetcher_keeps_order_and_stays_on_cpu() -> None:
    import torch

    from llmctl.engine.data import Batch
    from llmctl.engine.trainer import DevicePrefetcher

    src = [Batch(inputs=torch.full((1, 4), i), targets=torch.full((1, 4), i + 1)) for i in range(3)]
    got = list(DevicePrefetcher(iter(src), torch.device("cpu")))
    assert [int(b.inputs[0, 0]) for b in got] == [0, 1, 2]
    assert got[0].inputs is src[0].inputs  # no copy on a CPU device


def test_fsdp_only_where_it_does_something() -> None:
    from llmctl.engine.parallelize import needs_fsdp

    assert needs_fsdp(2, "fp32") and needs_fsdp(1, "bf16-mixed")
    assert not needs_fsdp(1, "fp32") and not needs_fsdp(1, "bf16")


@pytest.mark.parametrize(
    ("requested", "cuda", "compiled", "on", "needle"),
    [
        (False, True, True, False, "off"),
        (True, False, True, False, "needs CUDA"),
        (True, True, False, False, "needs training.compile"),
        (True, True, True, True, "micro-pipelined"),
    ],
)
def test_async_tp_runs_only_on_cuda_with_compile(
    requested: bool, cuda: bool, compiled: bool, on: bool, needle: str
) -> None:
    from llmctl.engine.tensor_parallel import select_async_tp

    got, why = select_async_tp(requested, cuda, compiled)
    assert got is on and needle in why
