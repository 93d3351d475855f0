"""The SDPA kernel the engine asks for (llmctl.engine.sdpa): the one the plan priced, by the same rule the planner
uses, first in SDPA's order for the run; which kernel SDPA then runs, and why when it differs. The CUDA device is
faked here (its compute capability, and SDPA's answer); tests/gpu checks the real one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmctl.engine import sdpa
from llmctl.spec.hardware import resolve_gpu
from llmctl.spec.kernels import architecture_of, kernel_for

LAYOUT = sdpa.Layout(heads=32, kv_heads=8, head_dim=128, v_head_dim=128, dtype=torch.bfloat16)
CUDA = SimpleNamespace(type="cuda", index=0)

# (catalog GPU, its compute capability: NVIDIA's CUDA GPUs table)
GPUS = [("V100", (7, 0)), ("T4", (7, 5)), ("A100-80GB", (8, 0)), ("A10G", (8, 6)), ("L40S", (8, 9))]
GPUS += [("H100-SXM", (9, 0)), ("H200", (9, 0)), ("B200", (10, 0))]


@pytest.mark.parametrize(("gpu", "capability"), GPUS)
def test_the_engine_asks_for_the_kernel_the_planner_priced(
    gpu: str, capability: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = resolve_gpu(gpu)
    assert architecture_of(capability) == spec.architecture
    asked: list[tuple[str, ...]] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(sdpa, "sdp_choice", lambda layout, device: asked.append(torch_order()) or "cudnn")
    before = torch._C._get_sdp_priority_order()
    choice = sdpa.choose(CUDA, "sdpa", LAYOUT)
    assert choice.priced == kernel_for("sdpa", spec)
    assert choice.order[0] == choice.priced and sorted(choice.order) == sorted(sdpa.ORDER)
    # SDPA was asked under the run's order, and the order was put back after
    assert asked == [tuple(choice.order)]
    assert torch._C._get_sdp_priority_order() == before


def torch_order() -> tuple[str, ...]:
    """SDPA's priority order now, in our kernel names (OVERRIDEABLE left out)."""
    names = {int(getattr(torch.nn.attention.SDPBackend, v)): k for k, v in sdpa.BACKEND_NAMES.items()}
    return tuple(names[i] for i in torch._C._get_sdp_priority_order() if i in names)


def test_cudnn_on_hopper_and_blackwell_flash_on_ampere_efficient_below() -> None:
    assert [architecture_of(c) for c in ((9, 0), (10, 0), (12, 0), (8, 0), (8, 9), (7, 5), (7, 0), (6, 1))] == [
        "hopper",
        "blackwell",
        "blackwell",
        "ampere",
        "ada",
        "turing",
        "volta",
        "unknown",
    ]


def test_when_sdpa_cannot_run_the_priced_kernel_the_run_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(sdpa, "sdp_choice", lambda layout, device: "fa2")
    choice = sdpa.choose(CUDA, "sdpa", LAYOUT)
    assert (choice.priced, choice.runs) == ("cudnn", "fa2")
    assert choice.why == "the plan priced cudnn, which cannot run this model's attention here"
    monkeypatch.setattr(sdpa, "sdp_choice", lambda layout, device: None)
    unknown = sdpa.choose(CUDA, "sdpa", LAYOUT)
    assert unknown.runs == "cudnn" and unknown.why == "SDPA could not be asked which kernel it runs"
    monkeypatch.setattr(sdpa, "sdp_choice", lambda layout, device: "cudnn")
    assert sdpa.choose(CUDA, "sdpa", LAYOUT).why is None


def test_not_sdpa_and_the_cpu_choose_nothing() -> None:
    assert sdpa.choose(CUDA, "flash_attention_2", LAYOUT) == sdpa.SdpaChoice(None, (), "flash_attention_2")
    cpu = sdpa.choose(torch.device("cpu"), "sdpa", sdpa.Layout(4, 2, 32, 32, torch.float32))
    assert cpu.order == () and cpu.priced is None and cpu.runs == "cpu-flash"
    before = torch._C._get_sdp_priority_order()
    with sdpa.applied(cpu):
        assert torch._C._get_sdp_priority_order() == before


def test_the_run_trains_under_the_chosen_order_and_restores_it() -> None:
    before = torch._C._get_sdp_priority_order()
    choice = sdpa.SdpaChoice("cudnn", sdpa.order_for("cudnn"), "cudnn")
    with sdpa.applied(choice):
        assert torch_order() == ("cudnn", "fa2", "efficient", "math")
        with sdpa.ordered(sdpa.order_for("efficient")):
            assert torch_order() == ("efficient", "cudnn", "fa2", "math")
        assert torch_order() == ("cudnn", "fa2", "efficient", "math")
    assert torch._C._get_sdp_priority_order() == before


def test_sdpa_is_asked_with_the_models_layout() -> None:
    """On this CPU SDPA answers for real: the layout's dtype and head dims reach it (the math path where its CPU flash
    kernel cannot run, such as differing query and value head dims)."""
    assert sdpa.sdp_choice(sdpa.Layout(4, 2, 32, 32, torch.float32), torch.device("cpu")) == "fa2"
    assert sdpa.sdp_choice(sdpa.Layout(4, 4, 48, 32, torch.float32), torch.device("cpu")) == "math"


def test_the_start_line_names_the_kernel_on_a_gpu_only() -> None:
    assert sdpa.SdpaChoice("cudnn", sdpa.order_for("cudnn"), "cudnn").words() == ", SDPA kernel cudnn"
    differs = sdpa.SdpaChoice("cudnn", sdpa.order_for("cudnn"), "fa2", "the plan priced cudnn, which cannot run")
    assert differs.words() == ", SDPA kernel fa2, not cudnn: the plan priced cudnn, which cannot run"
    assert sdpa.SdpaChoice(None, (), "cpu-flash").words() == ""


def test_a_run_asks_with_its_tp_shard_of_heads_and_its_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmctl.spec import models
    from llmctl.spec.setup import TrainSetup

    seen: list[sdpa.Layout] = []
    monkeypatch.setattr(
        sdpa, "choose", lambda device, impl, layout: seen.append(layout) or sdpa.SdpaChoice(None, (), impl)
    )
    at = models.resolve_model("llama-3.1-8b").layers[0].attention
    sdpa.for_run(CUDA, "sdpa", at, TrainSetup(precision="bf16-mixed", gpus_per_node=8, tp=4), say=False)
    sdpa.for_run(CUDA, "sdpa", at, TrainSetup(precision="fp32", gpus_per_node=8), say=False)
    assert seen == [sdpa.Layout(8, 2, 128, 128, torch.bfloat16), sdpa.Layout(32, 8, 128, 128, torch.float32)]
