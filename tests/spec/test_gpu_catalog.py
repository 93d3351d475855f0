"""The GPU catalog is data: every entry has every field, validated on load; a new GPU kind is one YAML entry."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import llmctl
from llmctl.cli.main import app
from llmctl.errors import SpecError
from llmctl.spec import hardware

FIELDS = {
    "name",
    "memory_mib",
    "tflops",
    "hbm_gbytes_s",
    "link_gbytes_s",
    "link",
    "architecture",
    "flash_attention",
    "efficiency",
    "efficiency_source",
    "aliases",
}
NODE_SHARES = {"node_cpus_per_gpu", "node_memory_gib_per_gpu"}
OPTIONAL = NODE_SHARES | {"host_link_gbytes_s", "node_memory_gbytes_s_per_gpu", "interconnect", "plan_only"}
"""Catalog fields an entry may leave out (a user's catalog too: node_gpus defaults to 8)."""
INTERCONNECTS = {
    "ib-edr-4x100",
    "ib-hdr-8x200",
    "ib-ndr-8x400",
    "ib-xdr-8x800",
    "eth-400",
    "eth-200",
    "eth-100",
    "eth-25",
    "nvl72-ndr",
    "nvl72-xdr",
}
"""The inter-node network classes of presets/interconnects.yaml that catalog entries name."""
NO_FLOAT8 = {"volta", "turing", "ampere"}
"""Architectures before float8 tensor cores (Ada, Hopper, Blackwell, CDNA3, Gaudi 3 have them)."""
FAKE = {
    "name": "Z1-96GB",
    "memory_mib": 98304,
    "tflops": {"bf16": 500.0, "fp16": 500.0, "tf32": 250.0, "fp32": 60.0},
    "hbm_gbytes_s": 2000,
    "link_gbytes_s": 200,
    "link": "ZLink",
    "architecture": "zed",
    "flash_attention": False,
    "efficiency": 0.5,
    "efficiency_source": "a made-up GPU for this test",
    "aliases": ["z1"],
}


def test_every_shipped_entry_has_every_field() -> None:
    raw = yaml.safe_load((Path(llmctl.__file__).parent / "spec/presets/gpus.yaml").read_text())
    # Every required field in every shipped entry, node_gpus too (the catalog states each kind's node); the node's
    # CPU and memory shares only where they are known (llmctl.launch.slurm_resources falls back otherwise).
    assert [set(e) - OPTIONAL for e in raw] == [FIELDS | {"node_gpus"}] * len(raw)
    assert all(set(e) & NODE_SHARES in (set(), NODE_SHARES) for e in raw)  # both node shares, or neither
    # CPU offload's host link is the GPU's own PCIe x16 (a datasheet fact): every shipped kind states it.
    assert all("host_link_gbytes_s" in e for e in raw)
    # and the network its clusters usually have, one of interconnects.yaml's classes
    assert all(e.get("interconnect") in INTERCONNECTS for e in raw), [e["name"] for e in raw]
    cat = hardware.gpu_catalog()
    assert sorted(cat) == sorted(e["name"] for e in raw)
    assert hardware.resolve_gpu("h100").name == "H100-SXM" and hardware.resolve_gpu("A100").name == "A100-80GB"
    assert not hardware.resolve_gpu("V100-32GB").flash_attention and hardware.resolve_gpu("MI300X").efficiency == 0.8


@pytest.mark.parametrize("field", sorted(FIELDS - {"name"}))
def test_a_missing_field_is_an_error_naming_it(field: str) -> None:
    entry = {k: v for k, v in FAKE.items() if k != field}
    with pytest.raises(SpecError, match=f"entry 1 \\(Z1-96GB\\): missing field '{field}'"):
        hardware.parse_catalog(yaml.safe_dump([entry]), "mine.yaml")


def test_every_shipped_gpu_has_a_plausible_memory_bandwidth() -> None:
    """hbm_gbytes_s is GB/s as the datasheet states it. Shipped entries span 2.4 (L40S: 864 GB/s over 362 TFLOP/s)
    to 8.6 (A10G: 600 over 70) bytes per kFLOP of bf16/fp16 peak; a bound of 1..40 keeps room for older or
    memory-rich parts (P100: ~35) and catches a TB/s typed as GB/s (3.35 -> 0.003) or GB/s typed as MB/s."""
    for g in hardware.gpu_catalog().values():
        assert g.hbm_gbytes_s > 0, g.name
        half = g.tflops["bf16"] or g.tflops["fp16"]
        assert half, g.name
        assert 1 <= g.hbm_gbytes_s / half <= 40, (g.name, g.hbm_gbytes_s, half)
    assert hardware.resolve_gpu("h100").hbm_gbytes_s == 3350 and hardware.resolve_gpu("a100").hbm_gbytes_s == 2039


def test_a_user_entry_without_memory_bandwidth_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = {k: v for k, v in FAKE.items() if k != "hbm_gbytes_s"}
    with pytest.raises(SpecError, match="entry 1 \\(Z1-96GB\\): missing field 'hbm_gbytes_s'") as err:
        hardware.parse_catalog(yaml.safe_dump([entry]), "mine.yaml")
    assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match="hbm_gbytes_s: Input should be greater than 0"):
        hardware.parse_catalog(yaml.safe_dump([{**FAKE, "hbm_gbytes_s": 0}]), "mine.yaml")
    # through $LLMCTL_GPU_CATALOG: exit 2 and one line naming the file and the field
    extra = tmp_path / "no-hbm.yaml"
    extra.write_text(yaml.safe_dump([entry]))
    monkeypatch.setenv(hardware.CATALOG_ENV, str(extra))
    r = CliRunner().invoke(app, ["estimate", "--list-gpus"])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "no-hbm.yaml" in lines[0] and "missing field 'hbm_gbytes_s'" in lines[0]


def test_bad_values_are_named() -> None:
    bad = {**FAKE, "tflops": {"bf16": 1.0, "fp32": 1.0}}
    with pytest.raises(SpecError, match="tflops: missing fp16, tf32"):
        hardware.parse_catalog(yaml.safe_dump([bad]), "mine.yaml")
    with pytest.raises(SpecError, match="unknown field 'colour'"):
        hardware.parse_catalog(yaml.safe_dump([{**FAKE, "colour": "green"}]), "mine.yaml")
    with pytest.raises(SpecError, match="a YAML list"):
        hardware.parse_catalog("name: x\n", "mine.yaml")


def test_a_new_gpu_through_yaml_alone_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One YAML entry, no code: estimate and plan know the GPU, and its facts (no flash, efficiency) are used."""
    extra = tmp_path / "gpus.yaml"
    extra.write_text(yaml.safe_dump([FAKE]))
    monkeypatch.setenv(hardware.CATALOG_ENV, str(extra))
    runner = CliRunner()
    r = runner.invoke(app, ["estimate", "--list-gpus"])
    assert r.exit_code == 0 and "Z1-96GB" in r.output
    # 0.5 reads like the old meaning (fraction of peak relative to an A100): said once, on stderr, still planned
    assert r.stderr.count("efficiency Z1-96GB (0.5) now discounts the kernel tables") == 1, r.stderr
    r = runner.invoke(
        app, ["plan", "llama-2-7b", "--gpu", "z1", "--gpus-per-node", "8", "--json", "--no-write", "--tp", "1"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["gpu"] == "Z1-96GB" and out["efficiency"]["gpu"] == 0.5
    assert all(c["attention"] != "flash" for c in out["candidates"])  # flash_attention: false is obeyed
    # the same plan on the fake GPU with efficiency 1.0 predicts exactly twice the compute rate
    # a second file later in the path list replaces the entry of the same name
    faster = tmp_path / "faster.yaml"
    faster.write_text(yaml.safe_dump([{**FAKE, "efficiency": 1.0}]))
    monkeypatch.setenv(hardware.CATALOG_ENV, f"{extra}{os.pathsep}{faster}")
    r2 = runner.invoke(
        app, ["plan", "llama-2-7b", "--gpu", "z1", "--gpus-per-node", "8", "--json", "--no-write", "--tp", "1"]
    )
    assert "faster.yaml" not in r2.stderr and "gpus.yaml: efficiency" in r2.stderr  # 1.0: the new meaning
    c1, c2 = out["chosen"], json.loads(r2.stdout)["chosen"]
    assert c2["efficiency"] == pytest.approx(2 * c1["efficiency"])
    monkeypatch.setenv(hardware.CATALOG_ENV, str(tmp_path / "missing.yaml"))
    r = runner.invoke(app, ["plan", "llama-2-7b", "--gpu", "z1", "--no-write"])
    assert r.exit_code == 2 and "no such GPU catalog ($LLMCTL_GPU_CATALOG)" in r.output and "missing.yaml" in r.output


def _logic_strings(tree: ast.AST) -> list[str]:
    """String constants that code branches or looks up on: compared, used as dict keys or subscripts, or listed in
    a tuple/list/set (a name table such as the old NO_FLASH_GPUS). Help texts and docstrings are prose."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            parts = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript):
            parts = [node.slice]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            parts = list(node.elts)
        else:
            continue
        out += [p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
    return out


def test_no_gpu_name_in_planner_or_cli_logic() -> None:
    """Per-GPU facts live in the catalog: no planner or CLI code compares with, looks up or lists a GPU kind."""
    cat = hardware.gpu_catalog()
    names = {n.lower() for n in cat} | {a for g in cat.values() for a in g.aliases}
    root = Path(llmctl.__file__).parent
    found = [
        f"{path.relative_to(root)}: {s!r}"
        for pkg in ("plan", "cli")
        for path in sorted((root / pkg).glob("*.py"))
        for s in _logic_strings(ast.parse(path.read_text()))
        if s.strip().lower() in names
    ]
    assert not found, found
    # the check itself finds what it is meant to find
    assert _logic_strings(ast.parse('NO_FLASH = ("V100-16GB", "V100-32GB")\nif g == "H100-SXM": pass')) == [
        "V100-16GB",
        "V100-32GB",
        "H100-SXM",
    ]


def test_the_fp8_column_is_the_dense_float8_peak_or_null() -> None:
    """Every shipped entry states fp8 (docs/sources.md#gpu-float8): twice the dense bf16 peak where the GPU has float8
    tensor cores (Ada, Hopper, Blackwell, MI300X; NVIDIA lists them with sparsity, halved), null before them."""
    raw = yaml.safe_load((Path(llmctl.__file__).parent / "spec/presets/gpus.yaml").read_text())
    assert all("fp8" in e["tflops"] for e in raw)
    fp8 = {e["name"]: e["tflops"]["fp8"] for e in raw}
    assert fp8 == {
        "V100-16GB": None,
        "V100-32GB": None,
        "T4": None,
        "A10G": None,
        "L4": 242.5,
        "L40S": 733.0,
        "A100-40GB": None,
        "A100-80GB": None,
        "H100-SXM": 1979.0,
        "H100-PCIe": 1513.0,
        "H200": 1979.0,
        "B200": 4500.0,
        "MI300X": 2614.9,
        "RTX-4090": 330.3,  # with fp32 accumulate (torch._scaled_mm's), as its bf16 peak
        "RTX-5090": 419.0,
        "RTX-6000-Ada": 728.5,
        "RTX-A6000": None,
        "L40": 362.0,
        "H20": 296.0,
        "GH200": 1979.0,
        "GH200-144GB": 1979.0,
        "H200-NVL": 1670.5,
        "B300": 4500.0,
        "GB200-NVL72": 5000.0,
        "GB300-NVL72": 5000.0,
        "MI325X": 2614.9,
        "MI355X": 5033.2,
        "Gaudi-3": 1835.0,
    }
    for g in hardware.gpu_catalog().values():
        if g.tflops["fp8"] is not None:
            # Gaudi 3's matrix engines run fp8 at the bf16 rate (Intel Gaudi 3 white paper); elsewhere twice bf16
            ratio = 1 if g.architecture == "gaudi3" else 2
            assert g.tflops["fp8"] == pytest.approx(ratio * g.tflops["bf16"], rel=0.025), g.name  # L40S: 733 / 362.05
            assert g.peak_tflops("fp8") == g.tflops["fp8"]


def test_fp8_is_null_exactly_before_float8_architectures() -> None:
    """fp8 is null on Volta, Turing and Ampere and given on every later architecture (Ada, Hopper, Blackwell, CDNA3+,
    Gaudi 3): a new entry of an old architecture with an fp8 peak, or of a new one without, is a typo."""
    cat = hardware.gpu_catalog()
    assert {g.architecture for g in cat.values()} >= NO_FLOAT8 | {"ada", "hopper", "blackwell", "cdna3", "cdna4"}
    for g in cat.values():
        assert (g.tflops["fp8"] is None) == (g.architecture in NO_FLOAT8), (g.name, g.architecture)


def test_new_kinds_resolve_by_their_aliases_and_rack_nodes_parse() -> None:
    """Short names people type reach the 2026 kinds; no alias is another kind's name or alias (resolve_gpu is
    case-insensitive); a rack-scale NVLink domain is one node of 72 (node_gpus up to 128)."""
    cat = hardware.gpu_catalog()
    names = [n.lower() for n in cat] + [a for g in cat.values() for a in g.aliases]
    assert len(names) == len(set(names))
    for alias, name in {
        "rtx4090": "RTX-4090",
        "5090": "RTX-5090",
        "a6000": "RTX-A6000",
        "gh200-96gb": "GH200",
        "gb200": "GB200-NVL72",
        "mi355": "MI355X",
        "gaudi3": "Gaudi-3",
    }.items():
        assert hardware.resolve_gpu(alias).name == name
    gb200 = hardware.resolve_gpu("GB200-NVL72")
    assert gb200.node_gpus == 72 and gb200.interconnect == "nvl72-ndr" and gb200.link == "NVLink5"
    (g,) = hardware.parse_catalog(yaml.safe_dump([{**FAKE, "node_gpus": 128}]), "x")
    assert g.node_gpus == 128 and g.interconnect is None and g.plan_only is None
    with pytest.raises(SpecError, match="node_gpus: Input should be less than or equal to 128"):
        hardware.parse_catalog(yaml.safe_dump([{**FAKE, "node_gpus": 129}]), "x")


def test_plan_only_is_the_reason_and_only_gaudi_has_it() -> None:
    """plan_only holds why the engine cannot run a kind: Gaudi 3 (the HPU bridge); every CUDA/ROCm kind runs."""
    cat = hardware.gpu_catalog()
    assert [g.name for g in cat.values() if g.plan_only] == ["Gaudi-3"]
    assert "habana_frameworks" in (cat["Gaudi-3"].plan_only or "")
    (g,) = hardware.parse_catalog(yaml.safe_dump([{**FAKE, "plan_only": "no engine here", "interconnect": "x"}]), "x")
    assert g.plan_only == "no engine here" and g.interconnect == "x"


def test_a_gpu_without_float8_refuses_it_in_one_line() -> None:
    with pytest.raises(SpecError) as err:
        hardware.resolve_gpu("a100").peak_tflops("fp8")
    assert err.value.message == "A100-80GB has no float8 tensor cores"
    assert err.value.hint == hardware.FLOAT8_HINT and "Ada, Hopper, Blackwell or MI300" in err.value.hint
    assert hardware.resolve_gpu("a100").peak_tflops("fp32") == 156.0  # fp32 still reads TF32, not fp8's fallback


def test_a_user_catalog_may_leave_fp8_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE has no fp8 (a catalog written before float8): read as null, and --precision fp8 is refused there."""
    (g,) = hardware.parse_catalog(yaml.safe_dump([FAKE]), "mine.yaml")
    assert g.tflops["fp8"] is None
    (g8,) = hardware.parse_catalog(yaml.safe_dump([{**FAKE, "tflops": {**FAKE["tflops"], "fp8": 1000.0}}]), "x")
    assert g8.peak_tflops("fp8") == 1000.0
    with pytest.raises(SpecError, match="tflops: peaks must be positive"):
        hardware.parse_catalog(yaml.safe_dump([{**FAKE, "tflops": {**FAKE["tflops"], "fp8": 0}}]), "x")
    extra = tmp_path / "gpus.yaml"
    extra.write_text(yaml.safe_dump([FAKE]))
    monkeypatch.setenv(hardware.CATALOG_ENV, str(extra))
    r = CliRunner().invoke(app, ["estimate", "llama-2-7b", "--gpu", "z1", "--precision", "fp8"])
    assert r.exit_code == 2 and "Z1-96GB has no float8 tensor cores" in r.output
    r = CliRunner().invoke(app, ["estimate", "--list-gpus"])
    assert r.exit_code == 0 and "fp8" in r.output
