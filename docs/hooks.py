"""MkDocs hook: the reference pages that must not drift are written at build time from the code itself.

- reference/cli.md: every command and option, walked from the typer app (`llmctl.cli.main.app`);
- reference/plan-schema.md: every plan-file key, from the pydantic model (`llmctl.spec.planfile.Plan`), with the
  attribute docstrings read from the source;
- reference/gpus.md: the GPU catalog (`llmctl.spec.hardware.gpu_catalog()`), shipped entries only.

A new option, plan key or GPU is documented by existing. tests/test_docs.py calls `cli_reference()` directly and checks
every option of every command is in it. Registered in mkdocs.yml (`hooks:`); excluded from the site (`exclude_docs`).
"""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------- markdown


def _esc(text: str) -> str:
    """Plain text into a markdown table cell: no HTML, no emphasis, no table breaks, one line."""
    text = " ".join(str(text).split())
    for a, b in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("*", "\\*"), ("[", "\\["), ("_", "\\_")):
        text = text.replace(a, b)
    return text


def _code(text: str) -> str:
    text = str(text).replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


# ------------------------------------------------------------------------------------------------- CLI reference


def _commands(group: Any, path: str) -> list[tuple[str, Any]]:
    """(command path, command) of every command under a click group, nested groups included, in help order."""
    out: list[tuple[str, Any]] = []
    ctx_cls = type(group).context_class
    names = group.list_commands(ctx_cls(group, info_name=path.split()[-1]))
    for name in names:
        cmd = group.commands[name]
        sub = f"{path} {name}"
        out.append((sub, cmd))
        if hasattr(cmd, "commands"):
            out += _commands(cmd, sub)
    return out


def _usage(cmd: Any, path: str) -> str:
    ctx = type(cmd).context_class(cmd, info_name=path)
    return f"{path} {' '.join(cmd.collect_usage_pieces(ctx))}".strip()


def _default(param: Any) -> str:
    d = param.default
    if d is None or callable(d) or getattr(param, "is_flag", False) and d is False and not param.secondary_opts:
        return ""
    if isinstance(d, bool) and param.secondary_opts:
        return param.opts[0] if d else param.secondary_opts[0]
    if isinstance(d, (list, tuple)):
        return ", ".join(str(x) for x in d) if d else ""
    return str(getattr(d, "value", d))


def _type(param: Any) -> str:
    """The value an option takes: its metavar, else its annotation (typer >= 0.2x resolves click types lazily)."""
    if getattr(param, "is_flag", False) or getattr(param, "is_bool_flag", False):
        return "flag"
    if getattr(param, "metavar", None):
        return _code(param.metavar)
    t = getattr(param, "type", None)
    choices = getattr(t, "choices", None)
    if choices:
        return " \\| ".join(_code(str(getattr(c, "value", c))) for c in choices)
    if t is not None:
        return _esc((getattr(t, "name", "") or "").lower())
    td = getattr(param, "type_descriptor", None)
    return _annotation(getattr(td, "annotation", None))


def _annotation(ann: Any) -> str:
    import enum
    import typing

    args = [a for a in typing.get_args(ann) if a is not type(None)]
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " \\| ".join(_code(a) for a in args)
    if origin in (list, tuple) and args:
        return f"{_annotation(args[0])} (repeatable)"
    if args and origin is not None and origin is not typing.Annotated:
        return _annotation(args[0])
    if origin is typing.Annotated:
        return _annotation(args[0])
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return " \\| ".join(_code(m.value) for m in ann)
    if ann is None:
        return ""
    return _esc(getattr(ann, "__name__", str(ann)).lower().replace("posixpath", "path"))


def option_names(param: Any) -> list[str]:
    """Every spelling of an option: `-o`, `--output`, `--no-compile`."""
    return [*param.opts, *param.secondary_opts]


def _params_table(cmd: Any) -> list[str]:
    args = [p for p in cmd.params if p.param_type_name == "argument"]
    opts = [p for p in cmd.params if p.param_type_name == "option" and not getattr(p, "hidden", False)]
    lines: list[str] = []
    if args:
        lines += ["**Arguments**", "", "| argument | type | required | description |", "|---|---|---|---|"]
        for p in args:
            name = (p.metavar or p.name or "").upper()
            lines.append(
                f"| {_code(name)} | {_type(p)} | {'yes' if p.required else 'no'} | "
                f"{_esc(getattr(p, 'help', '') or '')} |"
            )
        lines.append("")
    if opts:
        lines += ["**Options**", "", "| option | type | default | description |", "|---|---|---|---|"]
        for p in opts:
            names = " / ".join(_code(n) for n in option_names(p))
            default = _default(p)
            lines.append(
                f"| {names} | {_type(p)} | {_code(default) if default else ''} | "
                f"{_esc(p.help or '')}{' (required)' if p.required else ''} |"
            )
        lines.append("")
    return lines


def _help(cmd: Any) -> str:
    text = inspect.cleandoc(cmd.help or "").replace("\b\n", "")
    return "\n".join(line.rstrip() for line in text.splitlines())


def cli_reference() -> str:
    """The command reference as markdown, walked from the typer app."""
    import typer.main

    from llmctl.cli.main import app

    root = typer.main.get_command(app)
    out = [
        "# Command reference",
        "",
        "Generated from the command-line app itself when the docs are built (`docs/hooks.py`), so every command and",
        "every option below exists, and nothing that exists is missing. `llmctl COMMAND --help` prints the same.",
        "Errors and exit codes: [Exit codes](exit-codes.md); numbers and sizes take suffixes (`4k`, `2B`, `30d`),",
        "see [Plan the run](../how-to/plan.md#one-set-of-cluster-flags-and-sizes-with-suffixes).",
        "",
        "## `llmctl`",
        "",
        "```text",
        _usage(root, "llmctl"),
        "```",
        "",
        _esc(_help(root)),
        "",
        *_params_table(root),
        "| command | what it does |",
        "|---|---|",
    ]
    commands = _commands(root, "llmctl")
    for path, cmd in commands:
        first = (_help(cmd).split("\n\n")[0] if cmd.help else "").strip()
        out.append(f"| [{path}](#{_anchor(path)}) | {_esc(first)} |")
    out.append("")
    for path, cmd in commands:
        out += [f"## `{path}`", ""]
        out += ["```text", _usage(cmd, path), "```", ""]
        if cmd.help:
            out += ["```text", _help(cmd), "```", ""]
        out += _params_table(cmd)
    return "\n".join(out) + "\n"


def _anchor(path: str) -> str:
    """The id MkDocs' toc gives `## `llmctl data prepare``: lowercase words joined by '-'."""
    return "-".join(path.lower().split())


# ---------------------------------------------------------------------------------------------- plan schema


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a class (pydantic reads them only with use_attribute_docstrings)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = inspect.cleandoc(b.value.value)
    return docs


def _schema_type(s: dict[str, Any]) -> str:
    if "$ref" in s:
        return s["$ref"].rsplit("/", 1)[-1]
    if "enum" in s:
        return " \\| ".join(_code(v) for v in s["enum"])
    if "const" in s:
        return _code(s["const"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in s:
            return " or ".join(_schema_type(x) for x in s[key])
    t = s.get("type", "any")
    if t == "array":
        return f"list of {_schema_type(s.get('items', {}))}"
    if t == "object" and "additionalProperties" in s and isinstance(s["additionalProperties"], dict):
        return f"map of {_schema_type(s['additionalProperties'])}"
    return str(t)


def _bounds(s: dict[str, Any]) -> str:
    parts = []
    for key, sym in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in s:
            parts.append(f"{sym} {s[key]:,}" if isinstance(s[key], int) else f"{sym} {s[key]}")
    return ", ".join(parts)


def planfile_reference() -> str:
    """Every plan-file section and key, from the pydantic model."""
    from pydantic import BaseModel

    from llmctl.spec import planfile

    schema = planfile.Plan.model_json_schema()
    defs = schema.get("$defs", {})
    classes = {n: c for n, c in vars(planfile).items() if isinstance(c, type) and issubclass(c, BaseModel)}
    out = [
        "# Plan file schema",
        "",
        "Generated from the pydantic model `llmctl.spec.planfile.Plan` when the docs are built (`docs/hooks.py`).",
        "Unknown keys are refused (one line naming the key, exit 2), and every number is finite and capped.",
        "What the engine does with each key: [The plan file](../concepts/plan-file.md).",
        "",
    ]
    for name, s in [("Plan", schema), *sorted(defs.items())]:
        docs = _attribute_docs(classes[name]) if name in classes else {}
        out += [f"## {name}", ""]
        if s.get("description"):
            out += [_esc(s["description"]), ""]
        props = s.get("properties", {})
        if not props:
            out += [f"type: {_schema_type(s)}", ""]
            continue
        required = set(s.get("required", []))
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, p in props.items():
            typ = _schema_type(p)
            b = _bounds(p) or " ".join(_bounds(x) for x in p.get("anyOf", []) if _bounds(x))
            if b:
                typ += f" ({_esc(b)})"
            default = "required" if key in required else (_code(repr(p["default"])) if "default" in p else "")
            desc = docs.get(key) or p.get("description", "")
            out.append(f"| `{key}` | {typ} | {default} | {_esc(desc)} |")
        out.append("")
    out = [_link_refs(line, defs) for line in out]
    return "\n".join(out) + "\n"


def _link_refs(line: str, defs: dict[str, Any]) -> str:
    if not line.startswith("| `"):
        return line
    cells = line.split(" | ")
    for name in defs:
        cells[1] = " ".join(f"[{w}](#{name.lower()})" if w == name else w for w in cells[1].split(" "))
    return " | ".join(cells)


# ---------------------------------------------------------------------------------------------- GPU catalog


def gpu_reference() -> str:
    """The shipped GPU catalog (a $LLMCTL_GPU_CATALOG of the machine building the docs is left out)."""
    from llmctl.spec import hardware

    saved = os.environ.pop(hardware.CATALOG_ENV, None)
    try:
        catalog = hardware.gpu_catalog()
    finally:
        if saved is not None:
            os.environ[hardware.CATALOG_ENV] = saved
    out = [
        "# GPU catalog",
        "",
        "Generated from `llmctl.spec.hardware.gpu_catalog()` (`llmctl/spec/presets/gpus.yaml`) when the docs are",
        "built. `llmctl estimate-memory --list-gpus` prints the same; a site's own GPUs: see",
        "[Adding a GPU](../development/extending.md#a-gpu). Peaks are dense TFLOP/s; `efficiency` is the",
        "achievable fraction of peak relative to A100, with its source below the table.",
        "",
        "| name | memory GiB | bf16 | fp16 | tf32 | fp32 | fp8 | HBM GB/s | link GB/s | link | arch | flash | efficiency |"
        " GPUs/node | aliases |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|---|---|--:|--:|---|",
    ]

    def num(v: Any) -> str:
        return "-" if v is None else f"{v:g}"

    for g in catalog.values():
        t = g.tflops
        out.append(
            f"| {_esc(g.name)} | {g.memory_bytes / 2**30:.1f} | {num(t.get('bf16'))} | {num(t.get('fp16'))} | "
            f"{num(t.get('tf32'))} | {num(t.get('fp32'))} | {num(t.get('fp8'))} | {num(g.hbm_gbytes_s)} | "
            f"{num(g.link_gbytes_s)} | {_esc(g.link)} | {_esc(g.architecture)} | "
            f"{'yes' if g.flash_attention else 'no'} | {g.efficiency:g} | {g.node_gpus} | "
            f"{_esc(', '.join(g.aliases))} |"
        )
    out += ["", "## Sources and notes", ""]
    for g in catalog.values():
        note = f"- **{_esc(g.name)}**: efficiency {g.efficiency:g}: {_esc(g.efficiency_source or 'no source given')}"
        if g.plan_only:
            note += f". Plan only: {_esc(g.plan_only)}"
        out.append(note)
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------------ hook

PAGES = {
    "reference/cli.md": cli_reference,
    "reference/plan-schema.md": planfile_reference,
    "reference/gpus.md": gpu_reference,
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for path, make in PAGES.items():
        if files.get_file_from_path(path) is not None:
            raise RuntimeError(f"docs/{path} is generated by docs/hooks.py: remove the file")
        files.append(File.generated(config, path, content=make()))
    return files


if __name__ == "__main__":  # python docs/hooks.py OUTDIR: the generated pages, to read them without a build
    import sys

    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    for path, make in PAGES.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(make())
