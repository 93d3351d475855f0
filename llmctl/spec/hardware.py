"""GPU catalog and cluster shape (torch-free). Every per-GPU fact lives in presets/gpus.yaml with its source,
validated on load; nothing here or in the planner is keyed by a GPU name."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmctl.errors import InputError, SpecError, UnknownNameError, suggest
from llmctl.fileio import load_yaml, parse_yaml, read_input
from llmctl.spec.text import check_line
from llmctl.units import GIB, MIB

CATALOG_ENV = "LLMCTL_GPU_CATALOG"
"""Path(s) of extra GPU catalog YAML files (os.pathsep-separated), read after the shipped one; an entry with the name
of a shipped GPU replaces it."""
COMPUTE_DTYPES = ("bf16", "fp16", "tf32", "fp32")
OPTIONAL_DTYPES = ("fp8",)
"""Peaks a catalog entry may leave out (a user's catalog written before float8): read as null, no native support."""
FLOAT8_HINT = "use --precision bf16-mixed; float8 needs Ada, Hopper, Blackwell or MI300"


class _Entry(BaseModel):
    """One GPU kind as the catalog YAML spells it (see presets/gpus.yaml for what each field means)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    memory_mib: int = Field(gt=0)
    tflops: dict[Literal["bf16", "fp16", "tf32", "fp32", "fp8"], float | None]
    hbm_gbytes_s: float = Field(gt=0)
    link_gbytes_s: float = Field(gt=0)
    link: str
    architecture: str
    flash_attention: bool
    efficiency: float = Field(gt=0, le=2)
    efficiency_source: str = Field(min_length=1)
    aliases: list[str]
    node_gpus: int = Field(8, ge=1, le=128)
    """GPUs in the usual node of this kind (the default of --gpus-per-node); 8 when an entry does not say. Up to 128:
    a rack-scale NVLink domain (GB200 NVL72: 72) is one node."""
    node_cpus_per_gpu: int | None = Field(None, ge=1, le=1024)
    """SLURM CPUs per GPU that every listed node of this kind has (llmctl.launch.slurm_resources); None: unknown."""
    node_memory_gib_per_gpu: int | None = Field(None, ge=1, le=65536)
    """Host memory per GPU, GiB, that every listed node of this kind can give a job; None: unknown."""
    host_link_gbytes_s: float | None = Field(None, gt=0, le=10000)
    """The GPU's own link to the host (PCIe x16), GB/s per direction; None: unknown."""
    node_memory_gbytes_s_per_gpu: float | None = Field(None, gt=0, le=10000)
    """Peak host DRAM bandwidth per GPU, GB/s: the listed node's sockets x channels x transfer rate x 8 bytes over
    its GPUs (the smallest share among the nodes named); None: unknown."""
    interconnect: str | None = Field(None, min_length=1)
    """The inter-node network class a cluster of this kind usually has (a name in presets/interconnects.yaml, e.g.
    ib-ndr-8x400); None: unknown."""
    plan_only: str | None = Field(None, min_length=1)
    """Why llmctl's engine cannot run this kind (it runs on CUDA and ROCm torch devices): `plan` notes it, `launch`
    refuses its plans; None: the engine runs on it."""
    device: Literal["cuda", "cpu"] = "cuda"
    """The torch device its ranks run on: cuda (NVIDIA, and AMD through ROCm's cuda device), or cpu (presets/cpu.yaml:
    gloo, and a plan file's hardware.gpu null)."""

    @field_validator("name", "aliases")
    @classmethod
    def _one_line(cls, v: str | list[str]) -> str | list[str]:
        # A kind's name reaches plans, job scripts and terminals: one line of printable text, as a plan's names.
        for text in [v] if isinstance(v, str) else v:
            check_line(text)
        return v

    @field_validator("tflops")
    @classmethod
    def _all_dtypes(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        missing = [k for k in COMPUTE_DTYPES if k not in v]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (give null for no native support)")
        if v["fp32"] is None or any(x is not None and x <= 0 for x in v.values()):
            raise ValueError("peaks must be positive, and fp32 is always given")
        return {**dict.fromkeys(OPTIONAL_DTYPES), **v}


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator kind: usable memory, dense peak TFLOP/s per dtype, memory bandwidth, intra-node link, and
    what the planner needs to know about it (flash-attention support, a discount on the kernel tables)."""

    name: str
    memory_bytes: int
    """Total device memory as the driver reports it (nvidia-smi 'total')."""
    tflops: dict[str, float | None]
    """Dense peak TFLOP/s for bf16, fp16, tf32, fp32 and fp8 (float8 tensor cores; None: no native support)."""
    hbm_gbytes_s: float
    """Peak device-memory (HBM/GDDR) bandwidth, GB/s (datasheet): times memory-bound ops (norms, activations)."""
    link_gbytes_s: float
    """Per-GPU unidirectional intra-node link bandwidth, GB/s."""
    link: str
    architecture: str = "unknown"
    flash_attention: bool = True
    """flash-attention 2 runs on it."""
    efficiency: float = 1.0
    """A discount on the kernel tables' matmul and attention rates for this GPU (llmctl/spec/presets/kernels.yaml):
    1.0 takes them as they are; below 1 where this GPU's software stack is known to reach less than the table it
    falls back to (efficiency_source says why)."""
    efficiency_source: str = ""
    aliases: tuple[str, ...] = ()
    node_gpus: int = 8
    """GPUs in the usual node of this kind: what --gpus-per-node means when not given (presets/gpus.yaml)."""
    node_cpus_per_gpu: int | None = None
    """SLURM CPUs per GPU on the smallest common node of this kind: a partial node's share (None: not known)."""
    node_memory_gib_per_gpu: int | None = None
    """Host memory per GPU, GiB, on the smallest common node of this kind, less the OS's part (None: not known)."""
    host_link_gbytes_s: float | None = None
    """The GPU's own host link (PCIe x16), GB/s per direction, from its datasheet: what CPU offload's copies cross
    (None: not known, llmctl.plan.offload assumes PCIe 4.0)."""
    node_memory_gbytes_s_per_gpu: float | None = None
    """Peak host DRAM bandwidth per GPU, GB/s, on the common node of this kind with the smallest share: what CPU
    offload's optimizer step streams through (None: not known, llmctl.plan.offload's default node)."""
    interconnect: str | None = None
    """The inter-node network class a cluster of this kind usually has: a name in presets/interconnects.yaml
    (ib-ndr-8x400: 8 x 400G NDR per node, as DGX H100; eth-100; nvl72-ndr; ...). None: not known."""
    plan_only: str | None = None
    """Why llmctl's engine cannot run this kind, one clause (e.g. Intel Gaudi's HPU bridge): `llmctl plan` still
    plans for it and says so in a note, `llmctl launch` refuses its plans (exit 2). None: the engine runs on it."""
    device: str = "cuda"
    """cuda, or cpu for the host's cores (presets/cpu.yaml): a plan for it runs on gloo and says hardware.gpu null."""

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    def peak_tflops(self, dtype: str) -> float:
        """Peak for a compute dtype; 'fp32' training uses TF32 tensor cores when the GPU has them (PyTorch's
        matmul precision 'high'), else plain fp32; 'fp8' is the float8 tensor cores' peak (one line where there are
        none)."""
        if dtype == "fp8":
            v = self.tflops.get("fp8")
            if v is None:
                raise SpecError(f"{self.name} has no float8 tensor cores", hint=FLOAT8_HINT)
            return v
        if dtype in ("bf16", "fp16"):
            v = self.tflops.get(dtype)
            if v is None:
                raise SpecError(f"{self.name} has no native {dtype} support", hint="use --precision fp16 or fp32")
            return v
        return self.tflops.get("tf32") or self.tflops["fp32"] or 0.0


def _entry_error(err: ValidationError, source: str, raw: Any, index: int) -> SpecError:
    first = err.errors()[0]
    field = ".".join(str(x) for x in first["loc"])
    name = raw.get("name") if isinstance(raw, dict) else None
    which = f"entry {index + 1}" + (f" ({name})" if name else "")
    if first["type"] == "missing":
        return SpecError(f"{source}: {which}: missing field {field!r}", hint="see presets/gpus.yaml for every field")
    if first["type"] == "extra_forbidden":
        return SpecError(f"{source}: {which}: unknown field {field!r}")
    return SpecError(f"{source}: {which}: {field}: {first['msg'].removeprefix('Value error, ')}")


def parse_catalog(text: str, source: str) -> list[GPUSpec]:
    """Validate a catalog YAML (a list of entries) into GPUSpecs; any problem is one SpecError naming the field."""
    raw = parse_yaml(text, source)
    if not isinstance(raw, list):
        raise SpecError(f"{source}: a GPU catalog is a YAML list of entries (name, memory_mib, tflops, ...)")
    out = []
    for i, item in enumerate(raw):
        try:
            e = _Entry.model_validate(item)
        except ValidationError as err:
            raise _entry_error(err, source, item, i) from None
        out.append(
            GPUSpec(
                name=e.name,
                memory_bytes=e.memory_mib * MIB,
                tflops=dict(e.tflops),
                hbm_gbytes_s=e.hbm_gbytes_s,
                link_gbytes_s=e.link_gbytes_s,
                link=e.link,
                architecture=e.architecture,
                flash_attention=e.flash_attention,
                efficiency=e.efficiency,
                efficiency_source=e.efficiency_source,
                aliases=tuple(a.lower() for a in e.aliases),
                node_gpus=e.node_gpus,
                node_cpus_per_gpu=e.node_cpus_per_gpu,
                node_memory_gib_per_gpu=e.node_memory_gib_per_gpu,
                host_link_gbytes_s=e.host_link_gbytes_s,
                node_memory_gbytes_s_per_gpu=e.node_memory_gbytes_s_per_gpu,
                interconnect=e.interconnect,
                plan_only=e.plan_only,
                device=e.device,
            )
        )
    return out


def _warn_old_efficiency(entries: list[GPUSpec], shipped: list[GPUSpec], path: str) -> None:
    """`efficiency` changed meaning on 2026-11-27: it was the fraction of peak a step reaches relative to an A100
    (0.5-0.75 in the catalog of the time); it is now a discount on the kernel tables (1.0 for every NVIDIA kind). An
    entry below 0.8 (other than a shipped entry's own value, copied: MI355X's 0.73) was most likely written for the
    old meaning and would under-predict by that factor: say so once (the catalog is read once per process), on
    stderr, without refusing it."""
    same = {(g.name.lower(), g.efficiency) for g in shipped}
    low = [
        f"{g.name} ({g.efficiency:g})"
        for g in entries
        if g.efficiency < 0.8 and (g.name.lower(), g.efficiency) not in same
    ]
    if low:
        print(
            f"llmctl: warning: {path}: efficiency {', '.join(low[:3])}{', ...' if len(low) > 3 else ''} now discounts "
            "the kernel tables (1.0 takes them as they are; the shipped NVIDIA entries are 1.0), no longer the "
            "fraction of peak relative to an A100: set 1.0 unless this GPU's software stack reaches less",
            file=sys.stderr,
        )


@lru_cache(maxsize=4)
def _catalog(extra_paths: str) -> dict[str, GPUSpec]:
    shipped = resources.files("llmctl.spec").joinpath("presets/gpus.yaml").read_text()
    entries = parse_catalog(shipped, "presets/gpus.yaml")
    entries_shipped = list(entries)
    for path in filter(None, extra_paths.split(os.pathsep)):
        mine = parse_catalog(read_input(path, f"GPU catalog (${CATALOG_ENV})"), path)
        _warn_old_efficiency(mine, entries_shipped, path)
        entries += mine
    cat: dict[str, GPUSpec] = {}
    for g in entries:  # a later entry with the same name (a user's catalog) replaces the shipped one
        cat.pop(next((n for n in cat if n.lower() == g.name.lower()), ""), None)
        cat[g.name] = g
    return cat


def gpu_catalog() -> dict[str, GPUSpec]:
    """Every GPU kind: the shipped catalog plus the files named by $LLMCTL_GPU_CATALOG."""
    return _catalog(os.environ.get(CATALOG_ENV, ""))


@lru_cache(maxsize=1)
def cpu_spec() -> GPUSpec:
    """The host's cores as the planner sees them (presets/cpu.yaml): what `--gpu cpu` names, outside the GPU catalog
    (it is not a GPU to buy or compare)."""
    text = resources.files("llmctl.spec").joinpath("presets/cpu.yaml").read_text()
    (cpu,) = parse_catalog(text, "presets/cpu.yaml")
    return cpu


def resolve_gpu(name: str) -> GPUSpec:
    cat = gpu_catalog()
    key = name.strip().lower()
    for n, g in cat.items():
        if n.lower() == key:
            return g
    for g in cat.values():
        if key in g.aliases:
            return g
    cpu = cpu_spec()
    if key == cpu.name or key in cpu.aliases:
        return cpu
    raise UnknownNameError(
        f"unknown GPU kind {name!r}",
        hint=suggest(name.strip(), [*cat, cpu.name])
        or "see `llmctl estimate --list-gpus` (or cpu: this machine's cores)",
    )


def gpu_kind(name: str) -> str:
    """`name` when the catalog knows it (shipped, or $LLMCTL_GPU_CATALOG's files), else ValueError with the close
    names and where a kind of one's own goes: a plan's hardware.gpu."""
    try:
        resolve_gpu(name)
    except (UnknownNameError, SpecError) as e:  # an unknown kind, or a broken $LLMCTL_GPU_CATALOG file
        own = f"a kind of your own goes in a GPU catalog file named by ${CATALOG_ENV}"
        raise ValueError(f"{e.message} ({e.hint + '; ' if e.hint else ''}{own})") from None
    return name


class Cluster(BaseModel):
    """nodes x gpus_per_node of one GPU kind and the links between them: a cluster YAML file (`plan --cluster`),
    or built from flags (flags override the file)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gpu: str
    """GPU kind (a catalog name or alias)."""
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=1)
    inter_node_gbps: float | None = Field(None, gt=0)
    """Per node, all NICs together, Gbit/s (taken as achievable bus bandwidth)."""
    intra_node_gbps: float | None = Field(None, gt=0)
    """Per-GPU intra-node bus bandwidth, Gbit/s (default: catalog link x the link efficiency)."""
    price_per_gpu_hour: float | None = Field(None, ge=0)
    """USD per GPU-hour."""
    node_memory_gib: float | None = Field(None, gt=0)
    """Host memory per node a job can use, GiB: what CPU offload's states are checked against (default: the GPU
    kind's node_memory_gib_per_gpu x GPUs per node, where the catalog knows it)."""

    @property
    def gpu_spec(self) -> GPUSpec:
        return resolve_gpu(self.gpu)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def _cluster_error(err: ValidationError, source: str) -> SpecError:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    msg = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    return SpecError(f"{source}: {loc + ': ' if loc else ''}{msg}")


def cluster_shape(gpus: int | None, nodes: int | None, gpus_per_node: int | None, node_gpus: int) -> tuple[int, int]:
    """The one reading of --gpus / --nodes / --gpus-per-node (estimate, plan, tune, launch): (nodes, GPUs per node).
    `node_gpus` is what a node holds when --gpus-per-node is not given (the GPU kind's usual node, `node_gpus` in
    presets/gpus.yaml). --gpus up to a node's worth is one node of that many GPUs, beyond it whole nodes; nothing
    given is one node."""
    for flag, v in (("--gpus", gpus), ("--nodes", nodes), ("--gpus-per-node", gpus_per_node)):
        if v is not None and v < 1:
            raise InputError(f"{flag} must be a positive integer, got {v}")
    if gpus is not None and nodes is not None:
        raise InputError("give either --gpus or --nodes (with --gpus-per-node), not both")
    g = gpus_per_node or node_gpus
    if gpus is None:
        return nodes or 1, g
    if gpus <= g:
        return 1, gpus
    if gpus % g:
        raise InputError(
            f"--gpus {gpus} is not a whole number of nodes of {g} GPUs",
            hint=f"set --gpus-per-node, or use --nodes {-(-gpus // g)} --gpus-per-node {g}",
        )
    return gpus // g, g


def make_cluster(source: str = "the cluster", **fields: Any) -> Cluster:
    """A validated Cluster from fields (None values are left at their defaults; GPUs per node: the kind's usual
    node when not given)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if "gpus_per_node" not in fields and isinstance(fields.get("gpu"), str):
        with contextlib.suppress(SpecError):  # an unknown kind is reported where the cluster's GPU is resolved
            fields["gpus_per_node"] = resolve_gpu(fields["gpu"]).node_gpus
    try:
        return Cluster.model_validate(fields)
    except ValidationError as e:
        raise _cluster_error(e, source) from None


def load_cluster(path: str | os.PathLike[str], **overrides: Any) -> Cluster:
    """A cluster YAML file, with `overrides` (flags; None = not given) taking precedence over its values."""
    p = Path(path)
    data = load_yaml(p, "cluster file")
    if not isinstance(data, dict):
        raise SpecError(f"{p}: a cluster file must be a YAML mapping (gpu, nodes, gpus_per_node, ...)")
    return make_cluster(str(p), **{**data, **{k: v for k, v in overrides.items() if v is not None}})
