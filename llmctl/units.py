"""Byte sizes for people: one formatter ("64 MiB", "1.5 GiB") and one parser ("64M", "1GiB", "4096"), binary units
as nccl-tests' -b/-e and torch's memory stats use them. Torch-free, no imports beyond the standard library."""

from __future__ import annotations

import re

from llmctl.errors import InputError

KIB = 2**10
MIB = 2**20
GIB = 2**30

_UNITS = {"": 1, "b": 1} | {p + s: f for p, f in (("k", KIB), ("m", MIB), ("g", GIB)) for s in ("", "ib", "b")}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def fmt_bytes(n: int) -> str:
    """1536 -> '1.5 KiB', 64 MiB -> '64 MiB', 1023 -> '1023 B' (4 significant digits, the largest unit <= n)."""
    for unit, f in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= f:
            return f"{n / f:.4g} {unit}"
    return f"{n} B"


def gib(n: float | None, digits: int = 2) -> str:
    """A number for a column headed 'GiB': 12.34 GiB -> '12.34', thousands separated; None -> '-'."""
    return "-" if n is None else f"{n / GIB:,.{digits}f}"


def parse_bytes(text: str, what: str = "size") -> int:
    """'64MiB', '64M', '64mb', '1.5G', '4096' -> bytes. K/M/G and KB/MB/GB are binary too (as nccl-tests reads
    them). `what` names the value in the error ('message size')."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise InputError(f"bad {what} {text!r}", hint="use e.g. 1MiB, 64M, 1GiB or a byte count")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InputError(f"{what} must be positive, got {text!r}")
    return value


def duration(s: float | None) -> str:
    """Seconds as people read them: 42.0 s, 12.5 min, 3.1 h, 2.4 d."""
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.1f} min"
    if s < 86400 * 2:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"
