"""GPU catalog and cluster shape (torch-free). The figures live in presets/gpus.yaml with their sources."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

import yaml

from llmctl.errors import SpecError, UnknownNameError, suggest

GIB = 1024**3
MIB = 1024**2

# Short names people type, mapped to catalog entries.
_ALIASES = {
    "h100": "H100-SXM",
    "h100-80gb": "H100-SXM",
    "h100-sxm5": "H100-SXM",
    "a100": "A100-80GB",
    "a100-80g": "A100-80GB",
    "a100-40g": "A100-40GB",
    "v100": "V100-32GB",
    "h200-141gb": "H200",
    "mi300": "MI300X",
}


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator kind: usable memory, dense peak TFLOP/s per dtype, intra-node link bandwidth."""

    name: str
    memory_bytes: int
    """Total device memory as the driver reports it (nvidia-smi 'total')."""
    tflops: dict[str, float | None]
    """Dense peak TFLOP/s for bf16, fp16, tf32, fp32 (None: no native support)."""
    link_gbytes_s: float
    """Per-GPU unidirectional intra-node link bandwidth, GB/s."""
    link: str

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def peak_tflops(self, dtype: str) -> float:
        """Peak for a compute dtype; 'fp32' training uses TF32 tensor cores when the GPU has them (PyTorch's
        matmul precision 'high'), else plain fp32."""
        if dtype in ("bf16", "fp16"):
            v = self.tflops.get(dtype)
            if v is None:
                raise SpecError(f"{self.name} has no native {dtype} support", hint="use --precision fp16 or fp32")
            return v
        return self.tflops.get("tf32") or self.tflops["fp32"] or 0.0


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GPUSpec]:
    raw = yaml.safe_load(resources.files("llmctl.spec").joinpath("presets/gpus.yaml").read_text())
    return {
        e["name"]: GPUSpec(
            name=e["name"],
            memory_bytes=int(e["memory_mib"]) * MIB,
            tflops=dict(e["tflops"]),
            link_gbytes_s=float(e["link_gbytes_s"]),
            link=e["link"],
        )
        for e in raw
    }


def resolve_gpu(name: str) -> GPUSpec:
    cat = gpu_catalog()
    key = name.strip()
    for n, g in cat.items():
        if n.lower() == key.lower():
            return g
    alias = _ALIASES.get(key.lower())
    if alias:
        return cat[alias]
    raise UnknownNameError(
        f"unknown GPU kind {name!r}", hint=suggest(key, list(cat)) or "see `llmctl estimate-memory --list-gpus`"
    )


@dataclass(frozen=True)
class ClusterSpec:
    """nodes x gpus_per_node of one GPU kind, and the links between them."""

    gpu: GPUSpec
    nodes: int = 1
    gpus_per_node: int = 8
    inter_node_gbps: float | None = None
    """Per-node inter-node bandwidth in Gbit/s (all NICs of the node together), if known."""
    intra_node_gbytes_s: float | None = None
    """Override of the catalog's per-GPU intra-node link bandwidth, GB/s."""
    price_per_gpu_hour: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise SpecError(f"nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise SpecError(f"gpus per node must be >= 1, got {self.gpus_per_node}")
        if self.inter_node_gbps is not None and self.inter_node_gbps <= 0:
            raise SpecError(f"inter-node bandwidth must be positive, got {self.inter_node_gbps}")
        if self.price_per_gpu_hour is not None and self.price_per_gpu_hour < 0:
            raise SpecError(f"price per GPU-hour must be >= 0, got {self.price_per_gpu_hour}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node
