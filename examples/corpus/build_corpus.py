"""Assemble the example corpus from text every Python install has: the docstrings of the standard library.

Real English prose about programming (not random tokens), so a tiny model's loss falls meaningfully. The output
is committed (stdlib-docstrings.txt); rerun this to regenerate it (the exact text depends on the Python version):

    python examples/corpus/build_corpus.py [--max-bytes 600000]

With --jsonl FILE it writes one JSON line per docstring instead ({"text": ...}): a corpus of documents, the shape
`llmctl data prepare` reads (a validation split is a set of whole documents).

    python examples/corpus/build_corpus.py --jsonl runs/raw/docstrings.jsonl [--max-bytes 0 for all]
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent


def docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of one source file, in file order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    out = []
    for n in nodes:
        doc = ast.get_docstring(n)
        if doc and len(doc) > 80:  # skip one-liners: too little prose to learn from
            out.append(doc.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-bytes", type=int, default=600_000)
    ap.add_argument("--out", default=str(HERE / "stdlib-docstrings.txt"))
    ap.add_argument("--jsonl", default=None, help="write one {'text': docstring} line per document to this file")
    args = ap.parse_args()
    limit = args.max_bytes or float("inf")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for f in sorted(stdlib.glob("*.py")):  # top-level modules only: no tests, no site-packages
        for d in docstrings(f.read_text(encoding="utf-8", errors="replace")):
            d = d.encode("ascii", "ignore").decode()
            if size + len(d) + 2 > limit:
                break
            parts.append(d)
            size += len(d) + 2
    if args.jsonl:
        out = Path(args.jsonl)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps({"text": d}) + "\n" for d in parts))
    else:
        out = Path(args.out)
        out.write_text("\n\n".join(parts) + "\n")
    print(f"wrote {out}: {size:,} bytes from {len(parts)} docstrings of {stdlib}")


if __name__ == "__main__":
    main()
