"""The measured step split's pieces that run without a GPU (llmctl.engine.kernel_profile): the kernel-name
classification (names as an H100 profile of the engine showed them), the step range, the CPU run's one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmctl.engine import kernel_profile as kp
from llmctl.errors import InputError


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>",
            "optimizer",
        ),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0", "memory"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "memory"),
    ],
)
def test_kernels_are_classified_by_name(name: str, kind: str) -> None:
    assert kp.kind_of(name) == kind


def test_step_range_is_checked() -> None:
    assert kp.parse_steps("4:5") == (4, 5)
    for bad in ("5", "5:4", "0:2", "a:b"):
        with pytest.raises(InputError, match="LLMCTL_PROFILE_STEPS"):
            kp.parse_steps(bad)


def test_a_cpu_run_ignores_it_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(kp.PROFILE_ENV, "4:5")
    assert kp.StepProfiler.from_env(Path("."), "cpu") is None
    assert (
        capsys.readouterr().err.strip()
        == "llmctl: LLMCTL_PROFILE_STEPS ignored: the kernel profile is taken on CUDA runs"
    )
    monkeypatch.setenv(kp.PROFILE_ENV, "9:1")
    for device in ("cuda", "cpu"):  # a bad value fails on any machine, not only where it would be used
        with pytest.raises(InputError):
            kp.StepProfiler.from_env(Path("."), device)
    monkeypatch.delenv(kp.PROFILE_ENV)
    assert kp.StepProfiler.from_env(Path("."), "cuda") is None
