"""Property: whatever a plan file says, every reader of plan files either takes it or refuses it with one line that
names the key (exit 2), never an internal error or a traceback, within a time bound:
- the library: `plan_from_dict` and `load_plan` return a Plan or raise an InputError (SpecError) whose message is
  one printable line starting with the file and naming a key of the plan;
- the CLI: `llmctl launch PLAN --dry-run` (local, sbatch or submitit) exits 0, or 2 with exactly that line;
- the engine's entry point (`python -m llmctl.engine PLAN`, which validates before importing torch): for a plan
  that fails validation (only then: a valid plan would start training), exit 2 and that one line on stderr.
And a plan that is taken is one the engine can run: every number finite and within its cap, Adam's betas in [0, 1),
a seed torch and numpy take, a GPT-2's sequence within its positions (`_assert_runnable`).

Documents are the valid plans the project ships (every plan under examples/, the engine tests' TINY), each also as
llmctl writes it back (every key present), mutated by hypothesis: a bad value of any type at any key path, a key
deleted, an unknown or near-duplicate key added at any level, a section made a list; serialized with YAML's safe
dumper; and raw-text edits of the YAML (cut, spliced, a line duplicated, hostile constructs). Each cap and each
hostile construct is also hit once on purpose (ABSURD, HOSTILE_TEXTS): the fuzzer draws them only at random.

CI runs FUZZ_EXAMPLES examples per property (default 150);
`LLMCTL_FUZZ_EXAMPLES=3000 pytest tests/cli/test_fuzz_planfile.py` is the longer run by hand."""

from __future__ import annotations

import copy
import datetime
import functools
import io
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import typer.main
import typer.testing
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from typer.testing import CliRunner

from llmctl.bounds import GENERIC_FLOAT_LIMIT, GENERIC_INT_LIMIT, LIMITS
from llmctl.cli.main import app
from llmctl.engine.__main__ import main as engine_main
from llmctl.errors import PREFIX, InputError, LlmctlError, one_line
from llmctl.spec import models
from llmctl.spec import planfile as pf
from tests.engine.conftest import TINY, deep_update

REPO = Path(__file__).resolve().parents[2]
FUZZ_EXAMPLES = int(os.environ.get("LLMCTL_FUZZ_EXAMPLES", "150"))
TIME_BOUND_S = 2.0  # each reader decides in a few ms of CPU; CPU time (not wall time) so that other load cannot fail it
NAN, INF = float("nan"), float("inf")


# --- the valid plans mutations start from --------------------------------------------------------------------------
def _bases() -> list[tuple[str, dict[str, Any]]]:
    files = {str(p.relative_to(REPO)): yaml.safe_load(p.read_text()) for p in sorted(REPO.glob("examples/**/*.yaml"))}
    plans = {name: d for name, d in files.items() if isinstance(d, dict) and "training" in d}  # not cluster files
    shipped = [("TINY", TINY), *plans.items()]
    # As llmctl writes them back: every key present, so that mutations reach keys the hand-written files leave out.
    written = [(f"{n} (written back)", pf.plan_from_dict(d).model_dump(mode="json")) for n, d in shipped]
    return shipped + written


BASES = _bases()


def _schema_paths(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Dotted key path -> annotation, for every key the schema has (sections and their fields)."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        out[path] = info.annotation
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            out |= _schema_paths(info.annotation, f"{path}.")
    return out


SCHEMA = _schema_paths(pf.Plan)
TOP = {p for p in SCHEMA if "." not in p}
DOTTED = sorted((p for p in SCHEMA if "." in p), key=len, reverse=True)
# Keys that one check reads together: an error caused by one of them may name another (the shard size does not
# divide the world size that nodes x nproc_per_node make; flash needs a precision; ...).
COUPLED = [
    {
        "hardware",
        "hardware.nodes",
        "hardware.nproc_per_node",
        "parallel",
        "parallel.sharding",
        "parallel.shard_size",
        "training",
        "training.micro_batch_size",
        "training.grad_accum_steps",
        "training.seq_len",
        "training.max_steps",
        "training.token_budget",
    },
    {"training", "training.attention", "training.precision"},
    {"optimizer", "optimizer.lr", "optimizer.weight_decay"},
    {"model", "model.preset", "model.config", "model.weights", "model.overrides", "training.seq_len", "training"},
    {"data", "data.kind", "data.paths"},
]
FILE_LEVEL = ("not valid YAML", "a plan must be a YAML mapping", "empty plan file", "not a UTF-8 text file")


# --- documents -----------------------------------------------------------------------------------------------------
KeyPath = tuple[Any, ...]


def _paths(node: Any, prefix: KeyPath = ()) -> Iterator[KeyPath]:
    """Every key path of a document (mappings and list items), the root excluded."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


def _get(doc: Any, path: KeyPath) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _dotted(path: KeyPath) -> str:
    return ".".join(str(k) for k in path)


BAD_SCALARS = [
    None,
    "",
    " ",
    "abc",
    -1,
    0,
    1,
    -0.0,
    1.5,
    NAN,
    INF,
    -INF,
    1e30,
    1e12,
    2**40,
    2**64,
    2**70,
    -(2**70),
    10**30,
    True,
    False,
    "yes",
    "1e3",
    "12",
    "nan",
    "inf",
    "0x10",
    "x" * 5000,
    "a\x00b",
    "a\nb",
    "\x1b[31mred",
    "\u2028",
    "🙂",
    "$(id)",
    "../../../etc/passwd",
    datetime.date(2024, 1, 1),
]
BAD_VALUES = st.one_of(
    st.sampled_from(BAD_SCALARS),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(), st.text(max_size=4), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.floats(), st.text(max_size=4)), max_size=2),
)
NEW_KEYS = st.one_of(
    st.sampled_from(
        ["Training", "seq-len", "seq_len ", "SEQ_LEN", "micro_batch", "nodes", "lr", "betas", "preset", "paths"]
        + ["", " ", "a\nb", "k" * 300, "<<", "__class__", "model_config", 5, None]
    ),
    st.text(max_size=10),
)


def _near_duplicate(key: str) -> list[str]:
    """Spellings a person may type for an existing key: each is a different key, to be refused as unknown."""
    return [key.upper(), key.replace("_", "-"), f"{key} ", f" {key}", f"{key}s", key.title()]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[Any, ...]]]:
    """A base plan with 1-3 mutations; returns the document and the mutations, each (kind, key path)."""
    name, base = draw(st.sampled_from(BASES))
    doc = copy.deepcopy(base)
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(doc))
        kind = draw(st.sampled_from(["set", "set", "set", "delete", "add", "near-duplicate", "wrap"]))
        if kind in ("set", "delete", "wrap") and paths:
            path = draw(st.sampled_from(paths))
            parent, key = _get(doc, path[:-1]), path[-1]
            if kind == "set":
                parent[key] = draw(BAD_VALUES)
            elif kind == "wrap":  # a section or value made a list (a stray "- " in the YAML)
                parent[key] = [parent[key]]
            elif isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
            ops.append((kind, path))
        else:
            mappings = [()] + [p for p in paths if isinstance(_get(doc, p), dict)]
            where = draw(st.sampled_from(mappings))
            target = _get(doc, where)
            keys = [k for k in target if isinstance(k, str) and k]
            if kind == "near-duplicate" and keys:
                old = draw(st.sampled_from(keys))
                key = draw(st.sampled_from([k for k in _near_duplicate(old) if k != old] or ["x"]))
                target[key] = copy.deepcopy(target[old])
            else:
                kind, key = "add", draw(NEW_KEYS)
                target[key] = draw(BAD_VALUES)
            ops.append((kind, (*where, key)))
    return doc, ops


RAW_EDITS = [
    "cut",
    "splice",
    "duplicate-line",
    "delete-line",
    "indent",
    "dedent",
    "tab",
    "anchor-alias",
    "python-tag",
    "deep",
    "bom",
    "not-utf8",
    "huge-number",
    "nul",
]


@st.composite
def raw_documents(draw: st.DrawFn) -> bytes:
    """The YAML text of a valid plan (a shipped file's own text, or safe_dump of a base), edited as text."""
    name, base = draw(st.sampled_from(BASES))
    source = REPO / name
    text = source.read_text() if source.is_file() else yaml.safe_dump(base, sort_keys=False)
    lines = text.splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 2))):
        edit = draw(st.sampled_from(RAW_EDITS))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if edit == "cut":
            text = "".join(lines)[: draw(st.integers(0, len(text)))]
        elif edit == "splice":
            pos = draw(st.integers(0, len(text)))
            text = text[:pos] + draw(st.text(max_size=8)) + text[pos:]
        elif edit == "duplicate-line":  # an exact duplicate key, or a duplicate list item
            text = "".join(lines[: i + 1] + lines[i:])
        elif edit == "delete-line":
            text = "".join(lines[:i] + lines[i + 1 :])
        elif edit == "indent":
            text = "".join(lines[:i] + ["  " + lines[i]] + lines[i + 1 :])
        elif edit == "dedent":
            text = "".join(lines[:i] + [lines[i].lstrip(" ")] + lines[i + 1 :])
        elif edit == "tab":
            text = "".join(lines[:i] + ["\t" + lines[i]] + lines[i + 1 :])
        elif edit == "anchor-alias":
            text += "x: &a [1, 2]\ny: *a\n"
        elif edit == "python-tag":
            text += 'name: !!python/object/apply:os.system ["id"]\n'
        elif edit == "deep":
            depth = draw(st.sampled_from([50, 99, 101, 1000, 20000]))
            text += f"extra: {'[' * depth}{']' * depth}\n"
        elif edit == "bom":
            text = "\ufeff" + text
        elif edit == "not-utf8":
            return text.encode()[:i] + b"\xff\xfe" + text.encode()[i:]
        elif edit == "huge-number":
            text = re.sub(r"(seq_len|nodes|lr): .*", r"\1: " + "9" * draw(st.sampled_from([20, 400, 5000])), text)
        elif edit == "nul":
            text = text.replace("name: ", 'name: "a\\0b" #', 1)
        lines = text.splitlines(keepends=True) or [""]  # a cut can leave nothing
    return text.encode()


# --- what must hold ------------------------------------------------------------------------------------------------
def _assert_one_line_naming_a_key(msg: str, source: str, what: str) -> None:
    assert "\n" not in msg and "\r" not in msg and msg == one_line(msg), f"{what}\nnot one printable line: {msg!r}"
    assert msg.startswith(f"{source}: "), f"{what}\ndoes not start with the file: {msg!r}"
    assert len(msg) < len(source) + 1000, f"{what}\n{len(msg)} characters: {msg[:300]!r}..."
    rest = msg[len(source) + 2 :]
    if any(f in rest for f in FILE_LEVEL) or any(p in rest for p in DOTTED):
        return
    first = re.match(r"[A-Za-z_]*", rest).group()  # type: ignore[union-attr]
    assert first in TOP or "unknown key" in rest or "Keys should be strings" in rest, f"{what}\nnames no key: {msg!r}"


def _assert_names_the_mutation(msg: str, source: str, op: tuple[Any, ...], what: str) -> None:
    """With one mutation of a valid plan, the line names the mutated key; or, inside a value read as a whole (the
    overrides, Adam's betas), the key of that value; or a key that one check reads together with it (COUPLED)."""
    kind, path = op
    rest = msg[len(source) + 2 :]
    names = {_dotted(path[:n]) for n in range(2, len(path) + 1)} | {_dotted(path)}
    schema_path = ".".join(str(k) for k in path if not isinstance(k, int))
    names |= {k for group in COUPLED if schema_path in group for k in group if "." in k}

    def says(name: str) -> bool:
        shown = one_line(name)  # a key with a line break is escaped in the line
        if len(shown) > 50:  # long keys are shortened in the line (planfile.MAX_ECHO)
            return shown[:50] in rest
        if "." in shown:
            return shown in rest
        return re.match(rf"{re.escape(shown)}[.: ]", rest) is not None  # a top-level key: where the line starts

    if kind in ("add", "near-duplicate") and "unknown key" in rest:
        # The unknown key itself, as it is or quoted (an empty key, or one with a space at an end, is invisible).
        loc = rest.split(": unknown key")[0]
        shown = [one_line(_dotted((*path[:-1], k))) for k in (path[-1], repr(path[-1]))]
        assert any(loc == s or (len(s) > 50 and loc.startswith(s[:50])) for s in shown), f"{what}\n{shown}: {msg!r}"
        return
    assert any(says(n) for n in names if n), f"{what}\nthe line does not name {_dotted(path)!r}: {msg!r}"


def _numbers(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _numbers(v, f"{path}.{i}")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path, node


def _assert_runnable(plan: pf.Plan, what: str) -> None:
    """What the engine needs of a plan it is given (it would crash, hang or train garbage otherwise). Written from
    the engine's side (torch's and numpy's own limits), not copied from the schema's checks."""
    for where, v in _numbers(plan.model_dump()):
        if where == "training.seed":  # torch.manual_seed: uint64; numpy SeedSequence: >= 0
            assert 0 <= v < 2**64, what
            continue
        assert math.isfinite(v), f"{what}\n{where} = {v}"
        limit = GENERIC_INT_LIMIT if isinstance(v, int) else GENERIC_FLOAT_LIMIT
        assert abs(v) <= limit, f"{what}\n{where} = {v}"
    hw, t, o = plan.hardware, plan.training, plan.optimizer
    assert 1 <= hw.nodes <= LIMITS["--nodes"] and 1 <= hw.nproc_per_node <= LIMITS["--nproc-per-node"], what
    assert plan.world_size <= LIMITS["--gpus"], what
    assert 8 <= t.seq_len <= LIMITS["--seq-len"] and 1 <= t.micro_batch_size <= LIMITS["--micro-batch"], what
    assert t.grad_accum_steps >= 1 and plan.tokens_per_step <= LIMITS["--global-batch-tokens"], what
    assert 1 <= plan.total_steps <= pf.MAX_STEPS, what
    assert all(0 <= b < 1 for b in o.betas), f"{what}\ntorch.optim.AdamW refuses betas {o.betas}"
    assert 0 < o.lr <= pf.MAX_LR and o.eps > 0 and 0 <= o.lr * o.weight_decay < 1, what
    assert 0 <= o.min_lr_ratio <= 1 and o.warmup_steps >= 0, what
    assert t.grad_clip is None or t.grad_clip > 0, what
    assert 1 <= plan.model.pad_vocab_multiple <= pf.MAX_PAD_VOCAB_MULTIPLE, what
    strings = [plan.name, plan.logging.dir, plan.data.jsonl_field, *plan.data.paths]
    strings += [s for s in (plan.model.preset, plan.model.config, plan.model.weights, plan.data.tokenizer) if s]
    assert all(s and "\x00" not in s for s in strings), f"{what}\na path or name the engine cannot open: {strings}"
    if plan.model.preset:  # the engine's own construction of the model (llmctl.engine.model.base_spec)
        spec = models.from_hf_config(
            {**models.preset_entry(plan.model.preset)["config"], **plan.model.overrides}, name="fuzz"
        )
        assert spec.params <= models.MAX_PARAMS and spec.num_layers <= models.MAX_LAYERS, what
        for key in models.SIZE_FIELDS:
            v = plan.model.overrides.get(key)
            assert v is None or type(v) is int, f"{what}\ntransformers gets {key} = {v!r}"
        assert not spec.is_gpt2 or t.seq_len <= spec.max_position_embeddings, f"{what}\npast GPT-2's positions"
        # transformers: RoPE needs an even head_dim; LlamaConfig and GPT-2 split hidden_size into equal heads.
        assert spec.is_gpt2 or spec.head_dim % 2 == 0, f"{what}\nodd head_dim {spec.head_dim}"
        if spec.model_type in ("llama", "gpt2"):
            assert spec.hidden_size % spec.num_heads == 0, f"{what}\nhidden_size not a multiple of the heads"


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True  # a value drawn twice (one date object) is written twice, not as an alias the reader refuses


def _dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def _round_trips(text: str) -> bool:
    try:
        return _dump(yaml.safe_load(text)) == text
    except yaml.YAMLError:
        return False


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


EXECUTORS = [["--executor", "local"], ["--slurm"], ["--executor", "submitit"]]


@pytest.fixture(scope="module", autouse=True)
def _plain_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No debug mode (it re-raises instead of printing the line), rank 0 (the rank that says bad input); and each
    executor's modules imported once (submitit, jinja2: seconds on a loaded machine), outside the timed calls."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("LLMCTL_DEBUG", "LLMCTL_ERROR_FILE", "RANK"):
            mp.delenv(name, raising=False)
        # typer's CliRunner rebuilds the click command from the app on every call: 2/3 of a call's 40 ms of CPU.
        # The app does not change between calls: build it once (if typer renames this, calls are only slower).
        if hasattr(typer.testing, "_get_command"):
            mp.setattr(typer.testing, "_get_command", functools.cache(typer.main.get_command))
        path = tmp_path_factory.mktemp("warm-up") / "plan.yaml"
        path.write_text(yaml.safe_dump(TINY))
        for executor in EXECUTORS:
            CliRunner().invoke(app, ["launch", str(path), "--dry-run", *executor])
        yield


def _run_engine(path: Path) -> tuple[int, str, float]:
    err, out = io.StringIO(), io.StringIO()
    handlers = logging.root.handlers[:]
    start = time.process_time()
    try:
        with redirect_stderr(err), redirect_stdout(out):
            code = engine_main([str(path)])
    finally:
        logging.root.handlers[:] = handlers  # its logging.basicConfig must not outlive the call
    return code, err.getvalue() + out.getvalue(), time.process_time() - start


def _check(path: Path, executor: list[str], data: Any = None, op: tuple[Any, ...] | None = None) -> None:
    """Every reader on the plan file at `path` (and on `data`, the document it was dumped from, when given)."""
    source = str(path)
    what = f"{path.read_bytes()[:3000]!r}"

    # 1. the library
    start = time.process_time()
    try:
        plan: pf.Plan | None = pf.load_plan(path)
        message = None
    except LlmctlError as e:
        plan, message = None, str(e)
        assert isinstance(e, InputError) and e.exit_code == 2, f"{what}\n{type(e).__name__}: {e}"
    took = time.process_time() - start
    assert took < TIME_BOUND_S, f"{what}\nload_plan took {took:.1f} s"
    if message is None:
        assert plan is not None
        _assert_runnable(plan, what)
    else:
        _assert_one_line_naming_a_key(message, source, what)
        if op is not None:
            _assert_names_the_mutation(message, source, op, what)
    if data is not None:  # the dict reader agrees with the file reader on the document the file was dumped from
        try:
            same = pf.resolved(pf.plan_from_dict(data, source=source), path.parent)  # as the file's folder means it
            assert message is None and plan is not None and same == plan, f"{what}\nfile refused, dict taken"
        except LlmctlError as e:
            assert str(e) == message, f"{what}\nfrom the dict: {e}\nfrom the file: {message}"

    # 2. the CLI, in-process (a dry run: renders, starts and writes nothing)
    folder = path.parent
    before = _snapshot(folder)
    args = ["launch", str(path), "--dry-run", *executor]
    cwd = os.getcwd()
    os.chdir(folder)
    start = time.process_time()
    try:
        result = CliRunner().invoke(app, args, env={"LLMCTL_JOBS_DIR": str(folder / "jobs")})
    finally:
        os.chdir(cwd)
    took = time.process_time() - start
    out = result.output
    cli = f"{what}\n{args!r} -> exit {result.exit_code}:\n{out[-2000:]}"
    assert result.exit_code in (0, 2), cli
    # (a key the fuzzer made up may be called Traceback: what must not appear is Python's own)
    assert f"{PREFIX}internal error" not in out and "Traceback (most recent call last)" not in out, cli
    assert result.exception is None or isinstance(result.exception, SystemExit), cli
    errors = [line for line in out.splitlines() if line.startswith(PREFIX)]
    if result.exit_code:
        assert len(errors) == 1 and out.strip().splitlines()[-1] == errors[0], cli
    else:
        assert not errors and out.strip(), cli
    if message is not None:
        assert result.exit_code == 2 and errors == [PREFIX + message], cli
    assert took < TIME_BOUND_S, f"{cli}\ntook {took:.1f} s"
    assert _snapshot(folder) == before, f"{cli}\na dry run changed files"

    # 3. the engine's entry point, only on a plan it must refuse (a valid one would start training)
    if message is not None:
        code, said, took = _run_engine(path)
        engine = f"{what}\npython -m llmctl.engine -> {code}:\n{said[-2000:]}"
        assert code == 2 and said.splitlines() == [PREFIX + message], engine
        assert took < TIME_BOUND_S, f"{engine}\ntook {took:.1f} s"


# --- the properties ------------------------------------------------------------------------------------------------
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(document=mutated(), executor=st.sampled_from(EXECUTORS))
def test_any_mutation_of_a_valid_plan(document: tuple[dict[str, Any], list[tuple[Any, ...]]], executor: list[str]):
    data, ops = document
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        text = _dump(data)
        path.write_text(text)
        # The dict reader must agree with the file reader, where YAML gives the dict back as it was (a `<<` key is
        # a merge in YAML: the file says something else then).
        same = _round_trips(text)
        _check(path, executor, data=data if same else None, op=ops[0] if len(ops) == 1 and same else None)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=raw_documents(), executor=st.sampled_from(EXECUTORS))
def test_any_edit_of_a_plans_text(raw: bytes, executor: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.yaml"
        path.write_bytes(raw)
        _check(path, executor)


# Each cap the engine needs, hit on purpose (the fuzzer may not draw these exact values): (changes to TINY, the key
# the line must name).
ABSURD = [
    ({"training": {"seq_len": 10**12}}, "training.seq_len"),
    ({"training": {"seq_len": 1e12}}, "training.seq_len"),
    ({"training": {"seq_len": 4}}, "training.seq_len"),
    ({"training": {"micro_batch_size": 2**40}}, "training.micro_batch_size"),
    ({"training": {"micro_batch_size": 0}}, "training.micro_batch_size"),
    ({"training": {"grad_accum_steps": -1}}, "training.grad_accum_steps"),
    ({"training": {"max_steps": 10**30}}, "training.max_steps"),
    ({"training": {"max_steps": 0}}, "training.max_steps"),
    ({"training": {"max_steps": None, "token_budget": 0}}, "training.token_budget"),
    ({"training": {"max_steps": None, "token_budget": 10**15}}, "training.token_budget"),
    ({"training": {"seed": -1}}, "training.seed"),
    ({"training": {"seed": 2**64}}, "training.seed"),
    ({"training": {"grad_clip": NAN}}, "training.grad_clip"),
    ({"training": {"grad_clip": 0}}, "training.grad_clip"),
    ({"training": {"compile": "maybe"}}, "training.compile"),
    ({"hardware": {"nodes": 10**9}}, "hardware.nodes"),
    ({"hardware": {"nodes": 0}}, "hardware.nodes"),
    ({"hardware": {"nodes": True}}, "hardware.nodes"),
    ({"hardware": {"nproc_per_node": 2048}}, "hardware.nproc_per_node"),
    ({"hardware": {"nodes": 100_000, "nproc_per_node": 1024}}, "hardware.nodes"),
    ({"training": {"micro_batch_size": 1_000_000, "grad_accum_steps": 1000}}, "training.micro_batch_size"),
    ({"training": {"micro_batch_size": 100_000, "seq_len": 10_000_000}}, "training.seq_len"),
    ({"parallel": {"sharding": "hybrid_shard", "shard_size": 3}}, "parallel.shard_size"),
    ({"parallel": {"shard_size": 2}}, "parallel.shard_size"),
    ({"optimizer": {"lr": NAN}}, "optimizer.lr"),
    ({"optimizer": {"lr": INF}}, "optimizer.lr"),
    ({"optimizer": {"lr": "inf"}}, "optimizer.lr"),
    ({"optimizer": {"lr": 10.0}}, "optimizer.lr"),
    ({"optimizer": {"lr": -3e-4}}, "optimizer.lr"),
    ({"optimizer": {"lr": True}}, "optimizer.lr"),
    ({"optimizer": {"betas": [1.0, 0.95]}}, "optimizer.betas.0"),
    ({"optimizer": {"betas": [0.9, -0.1]}}, "optimizer.betas.1"),
    ({"optimizer": {"betas": [0.9, NAN]}}, "optimizer.betas.1"),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas"),
    ({"optimizer": {"eps": 0}}, "optimizer.eps"),
    ({"optimizer": {"eps": -INF}}, "optimizer.eps"),
    ({"optimizer": {"weight_decay": -0.1}}, "optimizer.weight_decay"),
    ({"optimizer": {"lr": 0.5, "weight_decay": 2.0}}, "optimizer.weight_decay"),
    ({"optimizer": {"warmup_steps": 10**30}}, "optimizer.warmup_steps"),
    ({"optimizer": {"min_lr_ratio": 1.5}}, "optimizer.min_lr_ratio"),
    ({"model": {"pad_vocab_multiple": 2**40}}, "model.pad_vocab_multiple"),
    ({"model": {"pad_vocab_multiple": 0}}, "model.pad_vocab_multiple"),
    ({"model": {"preset": "no-such-model"}}, "model.preset"),
    ({"model": {"overrides": {"num_attention_heads": 0}}}, "model.overrides"),
    ({"model": {"overrides": {"num_hidden_layers": 10**9}}}, "model.overrides"),
    ({"model": {"overrides": {"num_hidden_layers": 2, "hidden_size": 2**40}}}, "model.overrides"),
    ({"model": {"overrides": {"vocab_size": 2**60}}}, "model.overrides"),
    ({"model": {"overrides": {"num_hidden_layers": 2.5}}}, "model.overrides.num_hidden_layers"),
    ({"model": {"overrides": {"hidden_size": "64"}}}, "model.overrides.hidden_size"),
    ({"model": {"overrides": {"rope_theta": NAN}}}, "model.overrides"),
    ({"model": {"overrides": {"rope_scaling": {"factor": INF}}}}, "model.overrides"),
    ({"model": {"preset": "gpt2-tiny", "overrides": {}}, "training": {"seq_len": 2048}}, "training.seq_len"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
    ({"checkpoint": {"interval_steps": 10**30}}, "checkpoint.interval_steps"),
    ({"logging": {"interval_steps": -5}}, "logging.interval_steps"),
    ({"logging": {"dir": ""}}, "logging.dir"),
    ({"data": {"paths": [""]}}, "data.paths.0"),
    ({"data": {"paths": ["a\x00b"]}}, "data.paths.0"),
    ({"name": "x" * 5000}, "name"),
    ({"predicted": {"mfu": NAN}}, "predicted.mfu"),
    ({"predicted": {"tokens_per_s": -1.0}}, "predicted.tokens_per_s"),
    ({"version": True}, "version"),
    ({"version": 2}, "version"),
]


@pytest.mark.parametrize(("changes", "key"), ABSURD, ids=[f"{k}={i}" for i, (_, k) in enumerate(ABSURD)])
def test_what_the_engine_would_choke_on_is_refused_at_load(changes: dict[str, Any], key: str, tmp_path: Path) -> None:
    data = deep_update(TINY, changes)
    with pytest.raises(InputError) as refused:
        pf.plan_from_dict(data, source="plan.yaml")
    message = str(refused.value)
    assert message.startswith("plan.yaml: ") and key in message and "\n" not in message, message
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    _check(path, EXECUTORS[1], data=data)


TINY_TEXT = yaml.safe_dump(TINY, sort_keys=False)
# Each hostile construct of the text fuzzer, once for sure (the fuzzer draws them at random): (text, what the line says).
HOSTILE_TEXTS = [
    (TINY_TEXT + f"extra: {'[' * 1000}{']' * 1000}\n", "nested deeper than"),
    (TINY_TEXT + f"extra: {'{a: ' * 20000}{'}' * 20000}\n", "nested deeper than"),
    (TINY_TEXT + "x: &a [1, 2]\ny: *a\n", "aliases"),
    (TINY_TEXT + 'extra: !!python/object/apply:os.system ["id"]\n', "not valid YAML"),
    (TINY_TEXT.replace("seq_len: 64", "seq_len: " + "9" * 5000), "not valid YAML"),
    (TINY_TEXT.replace("seq_len: 64", "seq_len: 64\n  seq_len: 128"), "duplicate key 'seq_len'"),
    (TINY_TEXT.replace("name: engine-test", "name: 2024-02-30"), "day is out of range"),
    (TINY_TEXT.replace("name: engine-test", 'name: "a\\0b"'), "NUL"),
    (TINY_TEXT.replace("name: engine-test", "name: a\x1fb"), "not valid YAML line 1"),
    (TINY_TEXT.replace("training:", "\ttraining:"), "not valid YAML"),
    ("\ufeff" + TINY_TEXT, None),
    ("- " + TINY_TEXT.replace("\n", "\n  "), "a plan must be a YAML mapping"),
    ("# only a comment\n", "a plan must be a YAML mapping"),
    ("", "empty plan file"),
]


@pytest.mark.parametrize(("text", "needle"), HOSTILE_TEXTS, ids=[f"text{i}" for i in range(len(HOSTILE_TEXTS))])
def test_hostile_yaml_is_one_line(text: str, needle: str | None, tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    if needle is None:
        pf.load_plan(path)
    else:
        with pytest.raises(InputError, match=re.escape(needle)):
            pf.load_plan(path)
    _check(path, EXECUTORS[1])


def test_deep_flow_nesting_is_refused_before_the_scanner_reads_ahead(tmp_path: Path) -> None:
    """PyYAML's scanner reads up to 1,024 characters ahead per open `[` (a possible key): without the cap in the
    scanner, 1,000 `[` cost ~0.5 s of CPU before the depth check refuses them. CPU time: load does not move it."""
    path = tmp_path / "plan.yaml"
    path.write_text(TINY_TEXT + f"extra: {'[' * 20000}{']' * 20000}\n")
    start = time.process_time()
    with pytest.raises(InputError, match="nested deeper than"):
        pf.load_plan(path)
    assert time.process_time() - start < 0.2


def test_bytes_that_are_not_utf8_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_bytes(TINY_TEXT.encode()[:20] + b"\xff\xfe" + TINY_TEXT.encode()[20:])
    with pytest.raises(InputError, match="not a UTF-8 text file"):
        pf.load_plan(path)
    _check(path, EXECUTORS[0])


@pytest.mark.parametrize("name", [n for n, _ in BASES])
def test_the_bases_are_valid_and_runnable(name: str, tmp_path: Path) -> None:
    data = dict(BASES)[name]
    _assert_runnable(pf.plan_from_dict(data), name)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    _check(path, EXECUTORS[1], data=data)


def test_the_mutations_reach_every_key_of_the_schema() -> None:
    reached = {".".join(str(k) for k in p if not isinstance(k, int)) for _, d in BASES for p in _paths(d)}
    assert set(SCHEMA) <= reached, set(SCHEMA) - reached


def _bounds(annotation: Any) -> Iterator[tuple[type, list[Any]]]:
    """(int or float, bound metadata) for each number an annotation holds (Optional and tuples included)."""
    for arg in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(arg) is typing.Annotated:
            inner, *meta = typing.get_args(arg)
            for kind, more in _bounds(inner):
                yield kind, more + meta
        elif arg in (int, float):
            yield arg, []
        elif typing.get_origin(arg) is not None:
            yield from _bounds(arg)


def test_every_number_in_the_schema_has_both_bounds() -> None:
    """A number field added later without a cap fails here (the caps are what keep absurd plans out)."""
    found = 0
    for model in (pf.Plan, *(a for a in SCHEMA.values() if isinstance(a, type) and issubclass(a, BaseModel))):
        for name, info in model.model_fields.items():
            for kind, inner in _bounds(info.annotation):
                found += 1
                # Bounds in an alias (Beta) come as a FieldInfo holding them; the field's own are in its metadata.
                meta = [m for x in inner + list(info.metadata) for m in getattr(x, "metadata", [x])]
                lower = any(hasattr(m, "ge") or hasattr(m, "gt") for m in meta)
                upper = any(hasattr(m, "le") or hasattr(m, "lt") for m in meta)
                assert lower and upper, f"{model.__name__}.{name} ({kind.__name__}) lacks a bound: {meta}"
    assert found > 25


def test_the_engine_refuses_a_bad_plan_before_importing_torch(tmp_path: Path) -> None:
    """In a fresh interpreter (this one may have imported torch for other tests): the refusal is fast because
    torch is never imported on that path."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(deep_update(TINY, {"optimizer": {"betas": [1.5, 0.9]}})))
    code = (
        "import sys; from llmctl.engine.__main__ import main; rc = main([sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LLMCTL_DEBUG", "RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"{PREFIX}{path}: optimizer.betas.0: Input should be less than 1"]
