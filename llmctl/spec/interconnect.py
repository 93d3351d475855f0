"""Named interconnect classes for clusters that do not exist yet (`ib-ndr-8x400`, `eth-100`, `nvl72-ndr`, ...): the
per-node bandwidth between nodes that --inter-gbps would otherwise give, each with its source
(presets/interconnects.yaml). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmctl.errors import SpecError, UnknownNameError, suggest
from llmctl.fileio import parse_yaml

SHIPPED = "presets/interconnects.yaml"
SCALE_UP_DEFAULT = "ib-ndr-8x400"
"""The class of an NVLink GPU kind whose catalog entry names none: the 8-rail 400G node of DGX/HGX H100 and B200."""
OTHER_DEFAULT = "eth-100"
"""The class of any other GPU kind whose catalog entry names none: the 100 Gb/s of the PCIe-GPU cloud instance."""


@dataclass(frozen=True)
class Interconnect:
    """One interconnect class: the nodes' network, and optionally an intra-node bandwidth override."""

    name: str
    inter_node_gbps: float
    """Per node, all NICs together, Gbit/s, the nominal line rate (the planner's --inter-gbps)."""
    description: str
    source: str
    intra_node_gbps: float | None = None
    """Per-GPU intra-node bandwidth, Gbit/s (the planner's --intra-gbps); None: the GPU catalog's link."""


class _Class(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    inter_node_gbps: float = Field(gt=0, le=1_000_000, allow_inf_nan=False)
    intra_node_gbps: float | None = Field(None, gt=0, le=1_000_000, allow_inf_nan=False)
    description: str = Field(min_length=1)
    source: str = Field(min_length=1)


def _class_error(err: ValidationError, source: str, name: str) -> SpecError:
    first = err.errors()[0]
    field = ".".join(str(x) for x in first["loc"])
    if first["type"] == "missing":
        return SpecError(f"{source}: {name}: missing field {field!r}")
    if first["type"] == "extra_forbidden":
        return SpecError(f"{source}: {name}: unknown field {field!r}")
    return SpecError(f"{source}: {name}: {field + ': ' if field else ''}{first['msg']}")


def parse_interconnects(text: str, source: str) -> dict[str, Interconnect]:
    """Validate an interconnect YAML (a mapping of class name to fields); any problem is one SpecError line naming
    the class and the field."""
    raw: Any = parse_yaml(text, source)
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: interconnect classes are a YAML mapping of name to inter_node_gbps, ...")
    out: dict[str, Interconnect] = {}
    for name, fields in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise SpecError(f"{source}: {name!r}: a class name is a non-empty string")
        if name.lower() in (n.lower() for n in out):
            raise SpecError(f"{source}: {name}: given twice (names are case-insensitive)")
        try:
            c = _Class.model_validate(fields)
        except ValidationError as err:
            raise _class_error(err, source, name) from None
        out[name] = Interconnect(name, c.inter_node_gbps, c.description, c.source, c.intra_node_gbps)
    return out


@lru_cache(maxsize=1)
def interconnect_classes() -> dict[str, Interconnect]:
    """Every named class, from the shipped presets/interconnects.yaml (read once)."""
    return parse_interconnects(resources.files("llmctl.spec").joinpath(SHIPPED).read_text(), SHIPPED)


def resolve_interconnect(name: str) -> Interconnect:
    """The class called `name` (case-insensitive); an unknown name is one line with the closest names."""
    classes = interconnect_classes()
    key = name.strip().lower()
    for n, c in classes.items():
        if n.lower() == key:
            return c
    raise UnknownNameError(
        f"unknown interconnect class {name!r}",
        hint=suggest(name.strip(), list(classes)) or f"one of {', '.join(classes)}",
    )


def default_interconnect(gpu: Any) -> Interconnect:
    """The usual class of a GPU kind's cluster: the catalog entry's `interconnect` where it names one, else
    SCALE_UP_DEFAULT for NVLink GPUs and OTHER_DEFAULT for the rest."""
    named = getattr(gpu, "interconnect", None)
    if isinstance(named, Interconnect):
        return named
    if isinstance(named, str) and named.strip():
        return resolve_interconnect(named)
    link = str(getattr(gpu, "link", "") or "")
    return resolve_interconnect(SCALE_UP_DEFAULT if link.lower().startswith("nvlink") else OTHER_DEFAULT)
