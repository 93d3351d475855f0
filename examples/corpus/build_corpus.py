"""Assemble the example corpus from text every Python install has: the docstrings of the standard library.

Real English prose about programming (not random tokens), so a tiny model's loss falls meaningfully. The output
is committed (stdlib-docstrings.txt); rerun this to regenerate it (the exact text depends on the Python version):

    python examples/corpus/build_corpus.py [--max-bytes 600000]
"""

from __future__ import annotations

import argparse
import ast
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
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for f in sorted(stdlib.glob("*.py")):  # top-level modules only: no tests, no site-packages
        for d in docstrings(f.read_text(encoding="utf-8", errors="replace")):
            d = d.encode("ascii", "ignore").decode()
            if size + len(d) + 2 > args.max_bytes:
                break
            parts.append(d)
            size += len(d) + 2
    Path(args.out).write_text("\n\n".join(parts) + "\n")
    print(f"wrote {args.out}: {size:,} bytes from {len(parts)} docstrings of {stdlib}")


if __name__ == "__main__":
    main()
