"""Interconnect classes: the per-node bandwidths a hypothetical cluster's network is named by, with their sources."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmctl.errors import SpecError, UnknownNameError
from llmctl.spec.hardware import gpu_catalog
from llmctl.spec.interconnect import (
    Interconnect,
    default_interconnect,
    interconnect_classes,
    parse_interconnects,
    resolve_interconnect,
)

EXPECTED = {
    "ib-edr-4x100": 400,
    "ib-hdr-8x200": 1600,
    "ib-ndr-8x400": 3200,
    "ib-xdr-8x800": 6400,
    "eth-400": 400,
    "eth-200": 200,
    "eth-100": 100,
    "eth-25": 25,
    "nvl72-ndr": 72 * 400,
    "nvl72-xdr": 72 * 800,
}


def test_exactly_the_named_classes_with_their_bandwidths() -> None:
    classes = interconnect_classes()
    assert {n: c.inter_node_gbps for n, c in classes.items()} == EXPECTED
    for name, c in classes.items():
        assert isinstance(c, Interconnect) and c.name == name
        assert c.description.strip() and c.source.strip(), name
        assert c.intra_node_gbps is None, f"{name}: the GPU catalog's link is used inside a node"


def test_multi_rail_classes_are_rails_times_rate() -> None:
    for name, c in interconnect_classes().items():
        rails_x_rate = name.rsplit("-", 1)[-1]
        if "x" in rails_x_rate and rails_x_rate.replace("x", "").isdigit():
            rails, rate = (int(x) for x in rails_x_rate.split("x"))
            assert c.inter_node_gbps == rails * rate, name


def test_resolve_is_case_insensitive_and_suggests() -> None:
    assert resolve_interconnect(" IB-NDR-8x400 ").inter_node_gbps == 3200
    with pytest.raises(UnknownNameError) as info:
        resolve_interconnect("ib-ndr-8x4000")
    assert info.value.hint and "did you mean" in info.value.hint and "ib-ndr-8x400" in info.value.hint
    with pytest.raises(UnknownNameError, match="unknown interconnect class"):
        resolve_interconnect("token-ring")


def test_default_interconnect_falls_back_by_link() -> None:
    cat = gpu_catalog()
    for g in cat.values():
        if getattr(g, "interconnect", None):
            continue  # the catalog names its class: checked below
        expected = "ib-ndr-8x400" if g.link.lower().startswith("nvlink") else "eth-100"
        assert default_interconnect(g).name == expected, g.name
    assert default_interconnect(SimpleNamespace(link="NVLink4")).name == "ib-ndr-8x400"
    assert default_interconnect(SimpleNamespace(link="PCIe4")).name == "eth-100"
    assert default_interconnect(SimpleNamespace(link="InfinityFabric")).name == "eth-100"


def test_default_interconnect_reads_the_catalog_field() -> None:
    assert default_interconnect(SimpleNamespace(link="NVLink5", interconnect="NVL72-NDR")).name == "nvl72-ndr"
    assert default_interconnect(SimpleNamespace(link="PCIe4", interconnect=None)).name == "eth-100"
    given = resolve_interconnect("eth-25")
    assert default_interconnect(SimpleNamespace(link="NVLink4", interconnect=given)) is given
    with pytest.raises(UnknownNameError):
        default_interconnect(SimpleNamespace(link="NVLink4", interconnect="ib-nd"))
    for g in gpu_catalog().values():  # whatever the catalog names must be a class
        if getattr(g, "interconnect", None):
            assert default_interconnect(g).name.lower() == str(g.interconnect).lower()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- eth-100\n", "a YAML mapping"),
        ("eth-1: {inter_node_gbps: 1, description: d}\n", "eth-1: missing field 'source'"),
        ("eth-1: {inter_node_gbps: 0, description: d, source: s}\n", "eth-1: inter_node_gbps"),
        ("eth-1: {inter_node_gbps: 1, description: d, source: s, mtu: 9000}\n", "eth-1: unknown field 'mtu'"),
        ("eth-1: {inter_node_gbps: 1, description: d, source: s}\nETH-1: {inter_node_gbps: 1}\n", "given twice"),
    ],
)
def test_a_bad_class_file_is_one_line(text: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_interconnects(text, "ic.yaml")
    assert str(info.value).startswith("ic.yaml: ") and message in str(info.value)
    assert "\n" not in str(info.value)
