"""Property (issue 46): whatever text a plan file holds in any of its text fields, `llmctl launch --slurm` either
refuses the plan (exit 2, one line) or renders scripts - the sbatch template's, the tune job's, submitit's - that
`bash -n` accepts and that, run with stub srun/scontrol/torchrun/sbatch/python on PATH (each records its argv), run
only the stubs, with the arguments llmctl meant: no file an injected `touch` would make, no extra call.

The text fields are found in the schema (every field whose type holds a str, a Literal of strings, or
model.overrides' values), so a field added later is fuzzed too (test_every_text_field_is_fuzzed). The values: a fixed
hostile corpus (control characters of each kind, newlines, `$(...)`, backticks, `;`, quotes, `#`, leading dashes,
globs, redirections) in every field, each at once in the sbatch and submitit executors' path, the tune job built from
the plan that was taken. Identical scripts are run once (most fields never reach a script: their value is in the
job's plan.yaml, which no shell reads)."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import typing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import typer.main
import typer.testing
import yaml
from launch_helpers import CORPUS, HOSTILE, pwned, write_stub
from pydantic import BaseModel
from typer.testing import CliRunner

from llmctl.cli.main import app
from llmctl.launch import slurm
from llmctl.launch.backends import NEW_FOLDER
from llmctl.spec import planfile as pf
from llmctl.tune import workflow

HOSTILE_VALUES = [
    "x\ntouch PWNED_nl #",
    "x\rtouch PWNED_cr",
    "x\ty",
    "x\x1b]0;owned\x07",
    "x\x1b[2J",
    "x\x00y",
    "x\x7fy",
    "x\x85touch PWNED_nel",  # NEL, a C1 line break
    "x\u2028touch PWNED_ls",
    "x\u202ey",
    "$(touch PWNED_dollar)",
    "`touch PWNED_backtick`",
    "x; touch PWNED_semicolon",
    "x' ; touch PWNED_squote ; '",
    'x" ; touch PWNED_dquote ; "',
    "x # a comment",
    "--fakeroot",
    "-x",
    "x && touch PWNED_and || touch PWNED_or",
    "x | tee PWNED_pipe > PWNED_redirect",
    "%j %x",
    "x\\",
    "*",
    "{a,b}",
    "${PATH}",
    HOSTILE,
    HOSTILE.replace("\n", " "),
]

BASE: dict[str, Any] = {
    "version": 1,
    "name": "fuzz",
    "model": {"preset": "llama-tiny", "overrides": {"num_hidden_layers": 2}},
    "data": {"kind": "text", "paths": [str(CORPUS)], "tokenizer": "tok", "val": ["val.txt"]},
    "hardware": {"gpu": "H100-SXM", "nodes": 2, "nproc_per_node": 2},
    "training": {"max_steps": 3, "seq_len": 32},
    "finetune": {"method": "lora", "lora_targets": ["q_proj", "v_proj"]},
    "checkpoint": {"dir": "ckpt"},
    "logging": {"dir": "run", "wandb": {"project": "p", "name": "n", "entity": "e", "tags": ["t"]}},
}


def _holds_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(isinstance(a, str) for a in typing.get_args(annotation))
    return any(_holds_text(a) for a in typing.get_args(annotation))


def _sections(annotation: Any) -> list[type[BaseModel]]:
    found = [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []
    return found + [s for a in typing.get_args(annotation) for s in _sections(a)]


def text_fields(model: type[BaseModel] = pf.Plan, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, annotation) of every field of the schema that holds text, sections walked."""
    out = []
    for name, info in model.model_fields.items():
        for section in _sections(info.annotation):
            out += text_fields(section, f"{prefix}{name}.")
        if not _sections(info.annotation) and (_holds_text(info.annotation) or name == "overrides"):
            out.append((f"{prefix}{name}", info.annotation))
    return out


TEXT_FIELDS = text_fields()


def with_value(key: str, annotation: Any, value: str) -> dict[str, Any]:
    """BASE with `value` at `key`: an item of a list field, a value of model.overrides; the one model source."""
    data = yaml.safe_load(yaml.safe_dump(BASE))
    *path, last = key.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
    if last == "overrides":
        node[last] = {"fuzzed_note": value}
    elif "list" in str(annotation):
        node[last] = [value]
    else:
        node[last] = value
    if key in ("model.config", "model.weights"):
        del data["model"]["preset"], data["model"]["overrides"]
    return data


STUB_RECORD = 'printf "%s\\0" "$(basename "$0")" "$@" > "$STUB_CALLS/$(date +%s%N)-$$"'
STUBS = {
    "scontrol": STUB_RECORD
    + '\ncase "$1 $2" in\n  "show hostnames") echo node1 ;;\n  *) echo "NodeName=node1 NodeAddr=127.0.0.1" ;;\nesac',
    # srun runs the node step (bash -c SCRIPT) as node 1 of 1; anything else (submitit's python) is only recorded
    "srun": STUB_RECORD
    + '\nwhile [[ "$1" == --* ]]; do shift; done\nif [ "$1" = bash ]; then SLURMD_NODENAME=node1 "$@"; fi',
    "torchrun": STUB_RECORD,
    "sbatch": STUB_RECORD + '\necho "1;c"',
    "scancel": STUB_RECORD,
    "python": STUB_RECORD + '\n[ "$2" = llmctl.launch.preflight ] && echo node1\nexit 0',
}


@pytest.fixture
def stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, body in STUBS.items():
        write_stub(bindir, name, body)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")  # tune's check that sbatch exists
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")  # restored after the test
    # The job's torchrun and python as the PATH has them (not this venv's absolute paths): the stubs answer.
    monkeypatch.setattr(slurm, "node_python_and_torchrun", lambda: ("python", "torchrun"))
    if hasattr(typer.testing, "_get_command"):  # the app's click command, built once (not per invocation)
        monkeypatch.setattr(typer.testing, "_get_command", functools.cache(typer.main.get_command))
    return bindir


def run_script(text: str, bindir: Path, work: Path) -> list[list[str]]:
    """bash -n, then the script with only the stubs and /usr/bin:/bin on PATH; the stubs' calls in order."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / "job.sh"
    script.write_text(text)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0 and not check.stderr, check.stderr
    calls = work / "calls"
    calls.mkdir()
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(work),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "STUB_CALLS": str(calls),
    }
    subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, timeout=60)
    return [p.read_text().split("\0")[:-1] for p in sorted(calls.iterdir(), key=lambda p: p.name)]


def expect_sbatch_calls(calls: list[list[str]], plan_path: Path) -> None:
    names = [c[0] for c in calls]
    # the shared-folder check, the preflight, the rendezvous node and its address, the step, and in it this node's
    # address and torchrun
    assert names == ["srun", "python", "scontrol", "scontrol", "srun", "scontrol", "torchrun"], calls
    assert calls[0][-3:-1] == ["bash", "-c"] and slurm.SHARED_MARKER in calls[0][-1]
    assert calls[1][1:] == ["-m", "llmctl.launch.preflight"]
    assert calls[4][1:6] == ["--nodes=2", "--ntasks=2", "--nodelist=node1", "--ntasks-per-node=1", "bash"]
    torchrun = calls[6][1:]
    assert torchrun[0] == "--nnodes=2" and torchrun[-3:] == ["--module", "llmctl.engine", str(plan_path)], calls


def expect_tune_calls(calls: list[list[str]]) -> None:
    assert calls == [["python", "-m", "llmctl.tune.job", "<new trial folder>"]], calls


def expect_submitit_calls(calls: list[list[str]], folder: Path) -> None:
    (call,) = calls
    assert call[0] == "srun" and call[-5:] == [sys.executable, "-u", "-m", "submitit.core._submit", str(folder)]


class Runs:
    """Each distinct script is run once, in a folder of its own."""

    def __init__(self, root: Path, bindir: Path) -> None:
        self.root, self.bindir, self.seen = root, bindir, set()

    def run(self, kind: str, text: str) -> list[list[str]] | None:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        if digest in self.seen:
            return None
        self.seen.add(digest)
        work = self.root / f"{kind}-{digest}"
        if kind == "sbatch":
            (work / "jobs" / NEW_FOLDER).mkdir(parents=True)  # the events file goes there
            # the token a --dry-run's script checks for, where its job folder is (as submit would have written it)
            job_dir = self.root / "JOBS" / NEW_FOLDER
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / slurm.SHARED_MARKER).write_text(slurm.DRY_RUN_TOKEN + "\n")
        return run_script(text, self.bindir, work)


def check_case(key: str, annotation: Any, value: str, tmp_path: Path, runs: Runs) -> str:
    """One field, one value: 'refused' or 'taken' (then its three scripts were checked)."""
    data = with_value(key, annotation, value)
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(data, allow_unicode=False))
    jobs_dir = tmp_path / "jobs"
    results = {}
    for executor in ("sbatch", "submitit"):
        r = CliRunner().invoke(
            app, ["launch", str(plan), "--slurm", "--executor", executor, "--jobs-dir", str(jobs_dir), "--dry-run"]
        )
        results[executor] = r
        if r.exit_code != 0:
            lines = r.output.strip().splitlines()
            assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"llmctl: error: {plan}: "), (
                key,
                value,
                r.output,
            )
            assert lines[0].isprintable(), lines[0]
            return "refused"  # when the plan is read, for every executor alike
    assert all(r.exit_code == 0 for r in results.values()), (key, value, {k: r.output for k, r in results.items()})
    loaded = pf.load_plan(plan)
    tune_params = replace(workflow._sbatch_params(loaded, {}), workdir=str(tmp_path))
    scripts = {
        "sbatch": results["sbatch"].stdout,
        "submitit": results["submitit"].stdout,
        "tune": slurm.render_tune(tune_params),
    }
    for kind, text in scripts.items():
        calls = runs.run(kind, text.replace(str(jobs_dir), str(runs.root / "JOBS")))
        if calls is None:
            continue
        if kind == "sbatch":
            expect_sbatch_calls(calls, runs.root / "JOBS" / NEW_FOLDER / "plan.yaml")
        elif kind == "tune":
            expect_tune_calls(calls)
        else:
            expect_submitit_calls(calls, runs.root / "JOBS" / NEW_FOLDER / "submitit")
    return "taken"


def test_every_text_field_is_fuzzed() -> None:
    keys = {k for k, _ in TEXT_FIELDS}
    assert {"name", "hardware.gpu", "data.paths", "checkpoint.dir", "logging.wandb.tags", "model.overrides"} <= keys
    assert len(keys) >= 25, sorted(keys)
    pf.plan_from_dict(BASE)  # the base is a valid plan, with every optional text field given
    for key, annotation in TEXT_FIELDS:  # and each mutation lands on its field
        node: Any = with_value(key, annotation, "fuzzed")
        for part in key.split("."):
            node = node[part]
        assert "fuzzed" in str(node), key


@pytest.mark.parametrize(("key", "annotation"), TEXT_FIELDS, ids=[k for k, _ in TEXT_FIELDS])
def test_no_plan_text_runs_anything(
    key: str, annotation: Any, tmp_path: Path, stubs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runs = Runs(tmp_path / "runs", stubs)
    outcomes = {value: check_case(key, annotation, value, tmp_path, runs) for value in HOSTILE_VALUES}
    assert not pwned(tmp_path), pwned(tmp_path)
    # Control characters are refused in every field; text without them is taken where the field is free text.
    controls = [v for v in HOSTILE_VALUES if not v.isprintable()]
    assert all(outcomes[v] == "refused" for v in controls if key != "model.overrides"), outcomes
    if key == "name":
        assert all(outcomes[v] == "taken" for v in HOSTILE_VALUES if v.isprintable()), outcomes
        assert runs.seen, "the plan's name reaches the scripts: they were run"
    if key == "hardware.gpu":
        assert set(outcomes.values()) == {"refused"}, outcomes  # none of them is a GPU kind of the catalog
