"""What a GPU-hour costs, per GPU kind: rented on demand, reserved, or owned (bought, powered and cooled), each
figure with its source and the date it is from (presets/prices.yaml). A user's price file (`--prices FILE`, same
format) replaces whole entries of the GPU kinds it names, adds others, and may override the owned-hardware
defaults. Every problem in a file is one SpecError line naming the file, the entry and the field. Torch-free."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date
from importlib import resources
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmctl.errors import SpecError, UnknownNameError, suggest
from llmctl.fileio import parse_yaml, read_input
from llmctl.spec.hardware import resolve_gpu

SHIPPED = "prices.yaml"
"""How the shipped table is named in errors and in `describe` (it lives in llmctl/spec/presets/)."""
BASES = ("on-demand", "reserved", "owned")
HOURS_PER_YEAR = 8760
OWNED_FIELDS = ("amortisation_years", "electricity_usd_per_kwh", "pue", "utilisation")
_YMD = re.compile(r"\d{4}-\d{2}-\d{2}")
STALE_AFTER_DAYS = 730
"""A figure older than this (two years) is shown as stale wherever it is used: GPU-hour prices move by tens of
percent within a year or two (new generations, price cuts), and the shipped table keeps launch prices of older kinds
(V100: AWS's price of 2017) because no newer published figure was at hand. The figure stays (a stale price still
ranks kinds better than none); the output says its year and that it is stale."""


def _day(v: Any) -> date:
    """A YYYY-MM-DD date (YAML reads an unquoted one as a date, a quoted one as text), not in the future."""
    if isinstance(v, str) and _YMD.fullmatch(v.strip()):
        try:
            v = date.fromisoformat(v.strip())
        except ValueError:
            raise ValueError(f"{v.strip()!r} is not a calendar date") from None
    if type(v) is not date:  # a datetime is a date subclass: a time of day is not what this field holds
        raise ValueError(f"{v if isinstance(v, date) else repr(v)} is not a YYYY-MM-DD date")
    if v > date.today():
        raise ValueError(f"{v} is in the future")
    return v


def _amount(v: Any) -> Any:
    if isinstance(v, bool):  # YAML's true would otherwise read as 1.0
        raise ValueError(f"{v!r} is not a number")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{v} is not a finite number")
    return v


Day = Annotated[date, BeforeValidator(_day)]
Positive = Annotated[float, BeforeValidator(_amount), Field(gt=0, le=1e9, allow_inf_nan=False)]


class _Sourced(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str = Field(min_length=1)
    """Where the figure comes from: the provider's pricing page URL, a datasheet, an announcement."""
    date: Day
    """The date the figure is from (YYYY-MM-DD)."""
    note: str | None = None

    @field_validator("source")
    @classmethod
    def _named(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty: name the pricing page, datasheet or announcement")
        return v.strip()


class HourlyPrice(_Sourced):
    """A rental price, USD per GPU-hour."""

    usd_per_gpu_hour: Positive


class ReservedPrice(HourlyPrice):
    """A reservation's price, USD per GPU-hour, for a term (e.g. '1 year')."""

    term: str = Field(min_length=1)


class PurchasePrice(_Sourced):
    """What buying one GPU costs, USD; `includes` says what (a server's share, or the card alone)."""

    usd_per_gpu: Positive
    includes: str = Field(min_length=1)


class OwnedFigure(_Sourced):
    """One owned-hardware default (amortisation years, USD per kWh, PUE, utilisation) with its source."""

    value: Positive


class PriceEntry(BaseModel):
    """One GPU kind's prices; every basis is optional (a missing one is 'no price')."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    on_demand: HourlyPrice | None = None
    reserved: ReservedPrice | None = None
    purchase: PurchasePrice | None = None
    power_watts: float | None = Field(None, gt=0, le=100_000, allow_inf_nan=False)
    """Electricity per GPU, W: the GPU's TDP plus its share of the server (power_source says how)."""
    power_source: str | None = Field(None, min_length=1)
    note: str | None = None

    @model_validator(mode="after")
    def _power_is_sourced(self) -> PriceEntry:
        if (self.power_watts is None) != (self.power_source is None):
            raise ValueError("power_watts and power_source: give both (the watts, and what they include) or neither")
        if self.purchase is not None and self.power_watts is None:
            raise ValueError("purchase: needs power_watts and power_source (the owned cost includes electricity)")
        return self


class _Owned(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    amortisation_years: OwnedFigure | None = None
    electricity_usd_per_kwh: OwnedFigure | None = None
    pue: OwnedFigure | None = None
    utilisation: OwnedFigure | None = None
    """The fraction of the amortisation period the GPUs do paid work (default 1: every hour)."""

    @model_validator(mode="after")
    def _ranges(self) -> _Owned:
        for name, low, high in (
            ("amortisation_years", 0, 30),
            ("electricity_usd_per_kwh", 0, 10),
            ("pue", 1, 5),
            ("utilisation", 0, 1),
        ):
            fig = getattr(self, name)
            if fig is None:
                continue
            closed = name == "pue"  # a PUE of exactly 1 (no overhead at all) is the ideal, not an error
            above_low = fig.value >= low if closed else fig.value > low
            if not (above_low and fig.value <= high):
                raise ValueError(f"{name}.value: {fig.value:g} is outside {'[' if closed else '('}{low}, {high}]")
        return self


@dataclass(frozen=True)
class PriceQuote:
    """One GPU kind's price on one basis, with where it comes from."""

    usd_per_gpu_hour: float
    basis: str
    """on-demand, reserved or owned."""
    source: str
    date: date
    """The date of the figure (owned: the oldest of the figures it is computed from)."""
    note: str
    origin: str = SHIPPED
    """The price file the figure came from: SHIPPED, or the user's file as given."""

    def age_days(self, today: date) -> int:
        return (today - self.date).days

    def is_stale(self, today: date) -> bool:
        """Older than STALE_AFTER_DAYS: the output marks it with its year."""
        return self.age_days(today) > STALE_AFTER_DAYS


@dataclass(frozen=True)
class PriceTable:
    """The shipped prices with a user's file over them. Keys are catalog GPU names."""

    entries: Mapping[str, PriceEntry]
    origins: Mapping[str, str]
    """GPU name -> the file its entry came from."""
    owned: Mapping[str, OwnedFigure]
    owned_origins: Mapping[str, str]

    def entry(self, gpu_name: str) -> PriceEntry | None:
        """The entry of a GPU kind (any catalog name or alias); None if the table has none."""
        return self.entries.get(resolve_gpu(gpu_name).name)

    def quote(self, gpu_name: str, basis: str) -> PriceQuote | None:
        """A GPU kind's price per GPU-hour on `basis` (on-demand, reserved, owned); None where the table has no
        figure. An unknown GPU kind or basis is one line with the closest names."""
        basis = _basis(basis)
        name = resolve_gpu(gpu_name).name
        e = self.entries.get(name)
        if e is None:
            return None
        origin = self.origins[name]
        if basis == "on-demand" and e.on_demand:
            p = e.on_demand
            return PriceQuote(p.usd_per_gpu_hour, basis, p.source, p.date, p.note or "", origin)
        if basis == "reserved" and e.reserved:
            r = e.reserved
            return PriceQuote(r.usd_per_gpu_hour, basis, r.source, r.date, f"term: {r.term}", origin)
        if basis == "owned" and e.purchase and e.power_watts is not None:
            return self._owned(e, origin)
        return None

    def _owned(self, e: PriceEntry, origin: str) -> PriceQuote | None:
        need = ("amortisation_years", "electricity_usd_per_kwh", "pue")
        if any(k not in self.owned for k in need):
            return None
        assert e.purchase is not None and e.power_watts is not None
        years, kwh, pue = (self.owned[k].value for k in need)
        util = self.owned["utilisation"].value if "utilisation" in self.owned else 1.0
        capital = e.purchase.usd_per_gpu / (years * HOURS_PER_YEAR * util)
        energy = e.power_watts / 1000 * pue * kwh
        used = [k for k in OWNED_FIELDS if k in self.owned]
        figures = [e.purchase.date, *(self.owned[k].date for k in used)]
        users = sorted({self.owned_origins[k] for k in used} - {SHIPPED})
        if origin == SHIPPED and users:
            origin = users[0]
        hours = f"{years:g} y x {HOURS_PER_YEAR} h" + (f" x {util:g} utilisation" if util != 1 else "")
        note = (
            f"owned: {e.purchase.usd_per_gpu:,.0f} USD / ({hours}) = {capital:.3f} USD/h"
            f" + {e.power_watts:g} W x PUE {pue:g} x {kwh:g} USD/kWh = {energy:.3f} USD/h;"
            f" purchase: {e.purchase.includes}"
        )
        return PriceQuote(capital + energy, "owned", e.purchase.source, min(figures), note, origin)


def _basis(basis: str) -> str:
    b = basis.strip().lower().replace("_", "-")
    if b not in BASES:
        raise UnknownNameError(
            f"unknown price basis {basis!r}", hint=suggest(basis.strip(), list(BASES)) or f"one of {', '.join(BASES)}"
        )
    return b


def _error(err: ValidationError, source: str, where: str) -> SpecError:
    """One line: the file, the entry, the field and what is wrong (hardware._entry_error's style)."""
    first = err.errors()[0]
    field = ".".join(str(x) for x in first["loc"])
    at = f"{source}: {where}: " if where else f"{source}: "
    if first["type"] == "missing":
        return SpecError(f"{at}missing field {field!r}", hint="see llmctl/spec/presets/prices.yaml for every field")
    if first["type"] == "extra_forbidden":
        return SpecError(f"{at}unknown field {field!r}")
    return SpecError(f"{at}{field + ': ' if field else ''}{first['msg'].removeprefix('Value error, ')}")


@dataclass(frozen=True)
class _Parsed:
    entries: dict[str, PriceEntry]
    owned: dict[str, OwnedFigure]


def parse_prices(text: str, source: str, strict_names: bool = True) -> _Parsed:
    """Validate a price file. GPU names resolve through the catalog; with `strict_names` an unknown one is an
    error naming the file and the entry, else (the shipped table, written ahead of a catalog that may lack a kind)
    it is kept under its own name."""
    raw = parse_yaml(text, source)
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: a price table is a YAML mapping (gpus: ..., owned: ...)")
    unknown = [k for k in raw if k not in ("gpus", "owned")]
    if unknown:
        raise SpecError(f"{source}: unknown key {unknown[0]!r}", hint="a price table has gpus and owned")
    try:
        owned = _Owned.model_validate(raw.get("owned") or {})
    except ValidationError as err:
        raise _error(err, source, "owned") from None
    gpus = raw.get("gpus") or {}
    if not isinstance(gpus, dict):
        raise SpecError(f"{source}: gpus: a mapping of GPU kind to its prices (on_demand, reserved, purchase, ...)")
    entries: dict[str, PriceEntry] = {}
    given: dict[str, str] = {}
    for key, fields in gpus.items():
        label = str(key)
        try:
            name = resolve_gpu(label).name
        except UnknownNameError as e:
            if strict_names:
                raise SpecError(f"{source}: {label}: {e.message}", hint=e.hint) from None
            name = label
        if name in given:
            same = given[name] + (f" ({name})" if given[name] != name else "")
            raise SpecError(f"{source}: {label}: the same GPU kind as {same}: give it once")
        given[name] = label
        try:
            entries[name] = PriceEntry.model_validate(fields if fields is not None else {})
        except ValidationError as err:
            raise _error(err, source, label) from None
    figures = {k: getattr(owned, k) for k in OWNED_FIELDS if getattr(owned, k) is not None}
    return _Parsed(entries, figures)


def load_prices(extra_path: str | None = None) -> PriceTable:
    """The shipped price table, then `extra_path` (the user's `--prices FILE`) over it: an entry there replaces the
    whole shipped entry of that GPU kind or adds one, and an owned-hardware default there replaces the shipped one."""
    shipped = parse_prices(
        resources.files("llmctl.spec").joinpath("presets/prices.yaml").read_text(), SHIPPED, strict_names=False
    )
    entries, owned = dict(shipped.entries), dict(shipped.owned)
    origins = dict.fromkeys(entries, SHIPPED)
    owned_origins = dict.fromkeys(owned, SHIPPED)
    if extra_path:
        user = parse_prices(read_input(extra_path, "price table"), str(extra_path))
        entries.update(user.entries)
        origins.update(dict.fromkeys(user.entries, str(extra_path)))
        owned.update(user.owned)
        owned_origins.update(dict.fromkeys(user.owned, str(extra_path)))
    return PriceTable(entries, origins, owned, owned_origins)


def describe(quotes: Mapping[str, PriceQuote | None], today: date) -> str:
    """One line saying which prices a comparison used and how old they are, e.g. `prices: on-demand, shipped table
    (prices.yaml), figures from 2017-10-25 to 2026-02-01 (oldest 3322 days old); RTX-4090: from my-prices.yaml;
    stale (over 2 years old, check them): V100-16GB from 2017-10-25`.
    `quotes` maps each GPU kind compared to its quote (None: no price)."""
    priced = {g: q for g, q in quotes.items() if q is not None}
    bases = sorted({q.basis for q in priced.values()}, key=lambda b: BASES.index(b) if b in BASES else len(BASES))
    parts = [f"prices: {'/'.join(bases) or 'none'}"]
    if any(q.origin == SHIPPED for q in priced.values()):
        parts.append(f"shipped table ({SHIPPED})")
    if priced:
        lo, hi = min(q.date for q in priced.values()), max(q.date for q in priced.values())
        oldest = max(q.age_days(today) for q in priced.values())
        span = f"from {lo}" + (f" to {hi}" if hi != lo else "")
        parts.append(f"figures {span} (oldest {oldest} day{'s' if oldest != 1 else ''} old)")
    line = ", ".join(parts)
    by_file: dict[str, list[str]] = {}
    for g, q in priced.items():
        if q.origin != SHIPPED:
            by_file.setdefault(q.origin, []).append(g)
    for origin, gpus in by_file.items():
        line += f"; {', '.join(gpus)}: from {origin}"
    stale = sorted((q.date, g) for g, q in priced.items() if q.is_stale(today))
    if stale:
        line += f"; stale (over {STALE_AFTER_DAYS // 365} years old, check them): " + ", ".join(
            f"{g} from {d}" for d, g in stale
        )
    missing = [g for g, q in quotes.items() if q is None]
    if missing:
        line += f"; no price: {', '.join(missing)}"
    return line
