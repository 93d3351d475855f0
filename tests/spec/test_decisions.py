"""The decision schema (llmctl.spec.decisions): each training decision is declared once, on its TrainSetup field, and
the plan file, the commands' flags, the planner's pins and search key and the engine's setup are derived from it.

The strongest check is the toy decision: a copy of the package gets one more field declared in llmctl/spec/setup.py
and nothing else, and the decision then reads and writes in a plan file (with its bounds), has its flag on
estimate-memory, plan and launch --dry-start, is pinned by the planner into its chosen setup and the plan it writes,
and is in the setup the engine's trainer runs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmctl.plan.space import Choice
from llmctl.spec import decisions as dec
from llmctl.spec.planfile import load_plan, plan_to_yaml, setup_sections
from llmctl.spec.setup import TrainSetup

REPO = Path(__file__).resolve().parents[2]
DECLARED = dec.declared(TrainSetup)


def test_every_decision_has_one_name_a_key_or_a_flag_and_help() -> None:
    names = [d.name for d in DECLARED]
    assert len(names) == len(set(names))
    for d in DECLARED:
        assert d.help.strip(), d.name
        assert d.in_file or d.flag, f"{d.name}: neither in the plan file nor on a command"
        assert set(d.commands) <= set(dec.COMMANDS), d.name
        if d.in_file:
            assert d.section in {"hardware", "parallel", "training", "optimizer", "finetune"}, d.key
    keys = [d.key for d in DECLARED if d.in_file]
    assert len(keys) == len(set(keys))


def test_values_and_with_values_reach_parts_by_name() -> None:
    s = dec.with_values(TrainSetup(gpus_per_node=8), tp=2, offload=True, cp=2)
    v = dec.values(s)
    assert (v["tp"], v["cp"], v["offload"], v["finetune"], v["lora_rank"]) == (2, 2, True, "full", 16)
    assert s.levers.offload and s.dims.tp_enabled and s.dims.cp_enabled
    lora = dec.with_values(TrainSetup(gpus_per_node=8), finetune="lora", lora_rank=8, cp=2)
    assert (lora.finetune.method, lora.finetune.rank, lora.cp) == ("lora", 8, 2)
    with pytest.raises(TypeError, match="no decision 'tpp'"):
        dec.with_values(s, tpp=2)


def test_the_plan_file_and_the_setup_are_inverse() -> None:
    plan = load_plan(REPO / "examples/tiny-cpu.yaml")
    s = plan.setup
    assert plan.setup is s  # derived once (the plan is frozen)
    moved = dec.with_values(s, cp=2, micro_batch_size=4, checkpointing="selective", attention="sdpa")
    again = plan.with_setup(moved)
    assert again.setup == moved and again.parallel.cp == 2 and again.training.activation_checkpointing == "selective"
    sections = setup_sections(moved)
    assert {k for d in DECLARED if d.in_file for k in [d.section]} == set(sections)
    assert plan_to_yaml(plan) == plan_to_yaml(plan.with_setup(s))  # decisions written only when asked stay out


def test_the_search_chooses_what_the_declarations_say_it_searches() -> None:
    """Choice (the planner's point) holds exactly the decisions with a search role of key or best, and the ones the
    search derives (nodes, accumulation, async TP); the search key is the key role's."""
    searched = {d.name for d in DECLARED if d.search in ("key", "best")}
    assert {f.name for f in dataclasses.fields(Choice)} == searched | {"nodes", "grad_accum_steps", "async_tp"}
    s = TrainSetup(gpus_per_node=8, tp=2, compile=True, checkpointing="full")
    assert dec.search_key(s) == (1, "full_shard", 2, 1, 1, "1f1b", None, 1, "full", 0, "sdpa", True)
    assert dec.as_json(s)["micro_batch"] == 1 and "offload" not in dec.as_json(s)
    assert dec.as_json(dec.with_values(s, offload=True))["offload"] is True


TOY = """
    toy: int = decision(
        1,
        key="training.toy",
        file_type=ft.Int,
        bounds={"ge": 1, "le": 64},
        write_default=False,
        flag="--toy",
        commands=("estimate", "plan", "dry-start"),
        help="A toy decision (tests/spec/test_decisions.py).",
    )
"""

CHECKS = r"""
import json, sys
from pathlib import Path
from typer.testing import CliRunner
from llmctl.cli.main import app
from llmctl.spec.planfile import plan_from_dict, plan_to_yaml, load_plan
from llmctl.errors import LlmctlError

work = Path(sys.argv[1])
out = {}
doc = {"model": {"preset": "llama-tiny"}, "training": {"max_steps": 2, "seq_len": 64, "toy": 3}}
plan = plan_from_dict(doc)
out["file"] = [plan.setup.toy, "toy: 3" in plan_to_yaml(plan), "toy" in plan_to_yaml(plan_from_dict({**doc, "training": {"max_steps": 2}}))]
try:
    plan_from_dict({**doc, "training": {"max_steps": 2, "toy": 65}})
    out["bounded"] = None
except LlmctlError as e:
    out["bounded"] = str(e)
run = CliRunner().invoke
out["help"] = ["--toy" in run(app, [c, "--help"], terminal_width=200).output for c in ("estimate", "plan", "launch")]
r = run(app, ["estimate", "llama-tiny", "--toy", "3", "--json"])
out["estimate"] = r.exit_code
r = run(app, ["plan", "llama-tiny", "--gpu", "A100-80GB", "--gpus-per-node", "2", "--precision", "fp32", "--seq-len", "128",
              "--global-batch", "16", "--toy", "5", "-o", str(work / "p.yaml")])
out["plan"] = [r.exit_code, r.output[-300:]]
written = load_plan(work / "p.yaml")
out["planned"] = written.setup.toy

from llmctl.launch.dry_start import _at
(work / "dry").mkdir()
out["dry_start"] = load_plan(_at(work / "p.yaml", {"toy": 7}, work / "dry")).setup.toy
r = run(app, ["launch", str(work / "p.yaml"), "--toy", "7"])
out["launch"] = [r.exit_code, r.output.strip()]

from llmctl.engine.checkpoint import StopSignal
from llmctl.engine.trainer import RankEnv, Trainer
out["engine"] = Trainer(written, RankEnv(0, 1, 0, False), StopSignal()).setup_.toy
print("RESULT " + json.dumps(out))
"""


def test_a_toy_decision_declared_once_reaches_the_file_the_flags_the_pins_and_the_engine(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "llmctl", copy / "llmctl", ignore=shutil.ignore_patterns("__pycache__"))
    setup_py = copy / "llmctl/spec/setup.py"
    text = setup_py.read_text()
    anchor = "\n    # --- optimizer ---"
    assert text.count(anchor) == 1
    setup_py.write_text(text.replace(anchor, TOY + anchor))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(copy), "LLMCTL_HOME": str(tmp_path / "home")}
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS, str(work)], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(line.removeprefix("RESULT "))
    assert got["file"] == [3, True, False]  # read into the setup, written when asked, left out at its default
    assert got["bounded"] and "training.toy" in got["bounded"] and "less than or equal to 64" in got["bounded"]
    assert got["help"] == [True, True, True]
    assert got["estimate"] == 0
    assert got["plan"][0] == 0, got["plan"]
    assert got["planned"] == 5  # the planner's pin, in its chosen setup and the plan file it wrote
    assert got["dry_start"] == 7
    assert got["launch"][0] == 2 and "--toy only applies with --dry-start" in got["launch"][1]
    assert got["engine"] == 5
