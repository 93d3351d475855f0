"""`llmctl plan --compare`'s options (Annotated aliases, as llmctl.cli.options) and their parsers: a deadline as
people write it (30d, 12h, 2w) and a budget in USD (500k, 1.2M)."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer

from llmctl.errors import InputError
from llmctl.spec.prices import BASES

CompareOpt = Annotated[
    Optional[str],
    typer.Option(
        "--compare",
        metavar="all|KIND,KIND",
        help="Compare GPU kinds (the whole catalog, or a list): per kind the fewest GPUs that fit, the count that meets "
        "--deadline (or the lowest cost per token), setup, tokens/s, days, cost; the cheapest and fastest named. Needs "
        "--tokens.",
    ),
]
DeadlineOpt = Annotated[
    Optional[str],
    typer.Option("--deadline", metavar="TIME", help="With --compare: finish within this, e.g. 30d, 12h, 2w."),
]
BudgetOpt = Annotated[
    Optional[str],
    typer.Option("--budget", metavar="USD", help="With --compare: exclude rows that cost more, e.g. 500k, 1.2M."),
]
PricesOpt = Annotated[
    Optional[str],
    typer.Option(
        "--prices",
        metavar="FILE",
        help="With --compare: a price YAML whose entries replace or add to the shipped table (spec/presets/prices.yaml).",
    ),
]
PriceBasisOpt = Annotated[
    str,
    typer.Option(
        "--price-basis",
        help="With --compare: on-demand | reserved | owned (purchase amortised, plus power).",
    ),
]
InterconnectOpt = Annotated[
    Optional[str],
    typer.Option(
        "--interconnect",
        metavar="CLASS",
        help="With --compare: the inter-node network of every kind's cluster (e.g. ib-ndr-8x400, eth-100; default: "
        "each kind's usual, see spec/presets/interconnects.yaml).",
    ),
]
PlotOpt = Annotated[
    Optional[str], typer.Option("--plot", metavar="FILE.png", help="With --compare: cost vs days per GPU kind.")
]

_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(m|min|h|d|w)\s*", re.IGNORECASE)
_SECONDS = {"m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_USD = re.compile(r"\s*\$?\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*")
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}


def parse_deadline(text: str) -> float:
    """'30d' -> seconds; minutes (m, min), hours (h), days (d) and weeks (w)."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise InputError(f"--deadline {text!r}: not a duration", hint="use a number and a unit, e.g. 30d, 12h, 2w")
    seconds = float(m.group(1)) * _SECONDS[m.group(2).lower()]
    if seconds <= 0:
        raise InputError(f"--deadline must be positive, got {text!r}")
    return seconds


def parse_budget(text: str) -> float:
    """'500k' -> 500000.0 USD; '$1.2M', '2e6' style plain numbers too."""
    m = _USD.fullmatch(text)
    if not m:
        try:
            value = float(text)
        except ValueError:
            raise InputError(f"--budget {text!r}: not an amount of USD", hint="e.g. 250000, 500k, 1.2M") from None
    else:
        value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not value > 0 or value == float("inf"):
        raise InputError(f"--budget must be a positive amount of USD, got {text!r}")
    return value


def check_basis(text: str) -> str:
    basis = text.strip().lower()
    if basis not in BASES:
        raise InputError(f"--price-basis {text!r}: unknown", hint="one of: " + ", ".join(BASES))
    return basis
