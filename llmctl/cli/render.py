"""Rendering helpers shared by the commands: number formats, rich tables, JSON output, PNG plots (lazy)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from llmctl.errors import InputError

# Piped output (CI logs, `| less`, README captures) gets a wide fixed width instead of rich's 80 columns.
_WIDTH = None if sys.stdout.isatty() else 160
console = Console(highlight=False, soft_wrap=False, width=_WIDTH)
err_console = Console(stderr=True, highlight=False)


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def table(title: str | None, columns: list[tuple[str, str]]) -> Table:
    """columns: (header, justify)."""
    t = Table(title=title, title_justify="left", title_style="bold", show_lines=False, pad_edge=False)
    for header, justify in columns:
        # A number is never cut ("38,0…"): when the table is wider than the terminal, the words wrap instead.
        t.add_column(
            header, justify=justify, no_wrap=justify == "right", min_width=len(header) if justify == "right" else None
        )  # type: ignore[arg-type]
    return t


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def plot_path(path: str) -> Path:
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise InputError(f"--plot {path}: the file name must end in .png")
    if not p.parent.exists():
        raise InputError(f"--plot {path}: folder {p.parent} does not exist")
    return p


def pyplot():
    """matplotlib's pyplot with a non-interactive backend, or one clear error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib", hint="pip install 'llmctl[plot]'") from None
    return plt


def save_figure(fig: Any, path: Path | str) -> None:
    """Write a matplotlib figure as PNG (110 dpi) and close it; a folder that cannot take it is one line."""
    plt = pyplot()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise InputError(f"--plot {path}: cannot write it: {e.strerror or e}") from None
    finally:
        plt.close(fig)
