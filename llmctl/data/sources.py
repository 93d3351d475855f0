"""Where documents come from: a small registry of source kinds, each an open / iterate / len triple.

A kind recognizes a path (a file suffix, or a folder marker), `open`s it (checking what can be checked cheaply:
the column exists, the extra is installed), `documents()` streams its texts (never the whole file in memory) and
`num_documents` says how many there are when that is known without reading the data (parquet and datasets
metadata), else None. A new format is one `SourceKind` entry in SOURCE_KINDS.

Kinds:
- text      .txt .md .rst   one document per file (and any file matching a `--glob`, e.g. '*.py')
- jsonl     .jsonl          one document per line, the string field --text-field (blank lines skipped)
- csv       .csv            one document per row, the column --text-field (stdlib csv: RFC 4180 quoting)
The three above are also read compressed (.gz .bz2 .xz .zst, streamed: `corpus.jsonl.zst`).
- parquet   .parquet        one document per row of the string column --text-field (pyarrow, row-group batches)
- hf-disk   a folder made by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk`
            (dataset_dict.json): one document per row of the column --text-field. Of a DatasetDict only the
            "train" split is read: its other splits are usually someone's held-out evaluation sets, which must not
            leak into training (pass `DIR/validation` to read one explicitly: each split is a Dataset folder).

Not here: `.json` arrays (they cannot be streamed without a streaming JSON parser; convert to JSON lines) and
`datasets.load_dataset(...)` builders (they write an Arrow cache of the whole corpus under ~/.cache first, which
the native readers above avoid).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from llmctl.errors import InputError

EXTRA_HINT = "pip install 'llmctl[data]'"
BATCH_ROWS = 1024
"""Rows per read of a columnar source (parquet, datasets): a few MB of text, never a whole row group of GBs."""


class Source(Protocol):
    path: Path
    num_documents: int | None
    """Documents in this source when its metadata says so (parquet, datasets), else None (text, jsonl, csv)."""

    def documents(self) -> Iterator[str]:
        """The texts, in file order, streamed."""
        ...


@dataclass(frozen=True)
class SourceKind:
    name: str
    open: Callable[[Path, str], Source]
    """(path, text field) -> an opened source; raises InputError (one line) for what it can check up front."""
    suffixes: tuple[str, ...] = ()
    """File suffixes of this kind (lower case)."""
    is_folder: Callable[[Path], bool] | None = None
    """For kinds stored as a folder: does this folder hold one (a folder kind is never expanded into its files)."""
    streams: bool = False
    """Read as one byte stream, so a compressed file of this kind (COMPRESSIONS) is read too."""


def _require(module: str, path: Path, what: str) -> Any:
    """Import an optional dependency, or one line naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise InputError(f"{path}: reading {what} needs the optional package {module!r}", hint=EXTRA_HINT) from None


def _read_error(path: Path, e: OSError) -> InputError:
    return InputError(f"{path}: cannot read ({e.strerror or e})")


# --- compressed files ------------------------------------------------------------------------------------------
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
"""Whole-file compressions read as a stream (gzip, bzip2 and xz from the standard library; zstd with the
`zstandard` package of the [data] extra): `corpus.jsonl.gz` is a jsonl file."""


def compression(path: Path) -> str | None:
    """The compression suffix of a file (`.gz`), or None."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def inner_suffix(path: Path) -> str:
    """The suffix that says the format: `.jsonl` of `corpus.jsonl.gz`."""
    return Path(path.stem).suffix.lower() if compression(path) else path.suffix.lower()


def open_stream(path: Path) -> Any:
    """A binary file object of `path`'s bytes, decompressed as they are read (never the whole file in memory)."""
    import io

    kind = compression(path)
    if kind == ".gz":
        import gzip

        return gzip.open(path, "rb")
    if kind == ".bz2":
        import bz2

        return bz2.open(path, "rb")
    if kind == ".xz":
        import lzma

        return lzma.open(path, "rb")
    if kind == ".zst":
        zstd = _require("zstandard", path, "zstd-compressed files")
        raw = path.open("rb")
        return io.BufferedReader(zstd.ZstdDecompressor().stream_reader(raw, closefd=True))
    return path.open("rb")


def _decompress_errors() -> tuple[type[BaseException], ...]:
    import lzma
    import zlib

    errors: list[type[BaseException]] = [EOFError, zlib.error, lzma.LZMAError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def stream_error(path: Path, e: BaseException) -> InputError:
    """One line for a file that cannot be read or decompressed."""
    if isinstance(e, OSError) and not compression(path):
        return _read_error(path, e)
    return InputError(f"{path}: cannot read ({compression(path) or 'file'} stream: {_first_line(e)})")


# --- text files ------------------------------------------------------------------------------------------------
@dataclass
class TextFile:
    """One document: the whole file (decoded as UTF-8, undecodable bytes replaced, as the engine's reader does)."""

    path: Path
    text_field: str = ""
    num_documents: int | None = 1

    def documents(self) -> Iterator[str]:
        try:
            with open_stream(self.path) as f:
                data = f.read()
        except (OSError, *_decompress_errors()) as e:
            raise stream_error(self.path, e) from None
        yield data.decode("utf-8", errors="replace")


@dataclass
class JsonlFile:
    """One document per non-blank line: the string `text_field` of the JSON object on it. Lines are split on "\\n"
    only (U+2028 inside a string is text, not a line break) and read one at a time."""

    path: Path
    text_field: str
    num_documents: int | None = None

    def documents(self) -> Iterator[str]:
        import json

        try:
            with open_stream(self.path) as f:
                for n, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        row = json.loads(raw.decode("utf-8"))  # str: json skips guessing the encoding of bytes
                    except UnicodeDecodeError as e:
                        raise InputError(f"{self.path}:{n}: not UTF-8 (byte {e.start} of the line)") from None
                    except json.JSONDecodeError as e:
                        raise InputError(f"{self.path}:{n}: not valid JSON ({e.msg})") from None
                    except RecursionError:
                        raise InputError(f"{self.path}:{n}: JSON nested too deeply") from None
                    text = row.get(self.text_field) if isinstance(row, dict) else None
                    if not isinstance(text, str):
                        raise InputError(
                            f"{self.path}:{n}: no string field {self.text_field!r}", hint="set --text-field"
                        )
                    yield text
        except (OSError, *_decompress_errors()) as e:
            raise stream_error(self.path, e) from None


@dataclass
class CsvFile:
    """One document per row: the column `text_field` (named in the header row)."""

    path: Path
    text_field: str
    num_documents: int | None = None

    def documents(self) -> Iterator[str]:
        import csv
        import io

        # A document is often longer than csv's default field limit (128 KiB); the limit is process-wide.
        csv.field_size_limit(2**31 - 1)
        try:
            with io.TextIOWrapper(open_stream(self.path), encoding="utf-8", newline="") as f:
                reader = csv.reader(f)
                try:
                    header = next(reader, None)
                    if header is None:
                        raise InputError(f"{self.path}: empty CSV file (no header row)")
                    if self.text_field not in header:
                        raise InputError(
                            f"{self.path}: no column {self.text_field!r} in the header ({', '.join(header[:10])})",
                            hint="set --text-field",
                        )
                    col = header.index(self.text_field)
                    for row in reader:
                        if not row:
                            continue
                        if col >= len(row):
                            raise InputError(f"{self.path}:{reader.line_num}: row has no column {self.text_field!r}")
                        yield row[col]
                except csv.Error as e:
                    raise InputError(f"{self.path}:{reader.line_num}: not valid CSV ({e})") from None
                except UnicodeDecodeError as e:
                    raise InputError(f"{self.path}: not UTF-8 (after line {reader.line_num}, {e.reason})") from None
        except (OSError, *_decompress_errors()) as e:
            raise stream_error(self.path, e) from None


# --- columnar sources --------------------------------------------------------------------------------------------
def _check_string_column(path: Path, field: str, names: Sequence[str], type_of: Callable[[str], Any]) -> None:
    if field not in names:
        shown = ", ".join(list(names)[:10]) + (", ..." if len(names) > 10 else "")
        raise InputError(f"{path}: no column {field!r} (columns: {shown})", hint="set --text-field")
    import pyarrow as pa

    t = type_of(field)
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)):
        raise InputError(f"{path}: column {field!r} holds {t}, not text", hint="set --text-field")


def _texts(path: Path, column: Any, first_row: int, field: str) -> list[str]:
    """The strings of one Arrow column chunk; a null is an error naming its row."""
    if column.null_count:
        row = first_row + next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
        raise InputError(f"{path}: row {row} (0-based) has no {field!r} (null)", hint="drop rows without text")
    return column.to_pylist()


@dataclass
class ParquetSource:
    """One document per row of a string column, read one batch of rows at a time (only that column)."""

    path: Path
    text_field: str
    num_documents: int | None = None

    def __post_init__(self) -> None:
        pq = _require("pyarrow.parquet", self.path, "parquet files")
        try:
            f = pq.ParquetFile(self.path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowIOError is an OSError, ArrowInvalid a ValueError
            raise InputError(f"{self.path}: not a readable parquet file ({_first_line(e)})") from None
        schema = f.schema_arrow
        _check_string_column(self.path, self.text_field, schema.names, lambda n: schema.field(n).type)
        self.num_documents = f.metadata.num_rows

    def documents(self) -> Iterator[str]:
        import pyarrow.parquet as pq

        row = 0
        try:
            f = pq.ParquetFile(self.path)
            for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=[self.text_field], use_threads=False):
                texts = _texts(self.path, batch.column(0), row, self.text_field)
                row += len(texts)
                yield from texts
        except (OSError, ValueError) as e:
            raise InputError(f"{self.path}: cannot read parquet (row {row}: {_first_line(e)})") from None


def is_saved_dataset(path: Path) -> bool:
    """A folder written by datasets' `save_to_disk`: a Dataset (state.json + dataset_info.json) or a DatasetDict
    (dataset_dict.json)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


@dataclass
class SavedDataset:
    """A `save_to_disk` folder, memory-mapped by datasets (its Arrow files are never loaded whole); of a DatasetDict,
    the "train" split (see the module docstring)."""

    path: Path
    text_field: str
    num_documents: int | None = None

    def __post_init__(self) -> None:
        datasets = _require("datasets", self.path, "Hugging Face datasets folders")
        datasets.disable_progress_bars()  # its "Loading dataset from disk" bar would interleave with ours
        try:
            ds = datasets.load_from_disk(str(self.path))
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"{self.path}: not a readable datasets folder ({_first_line(e)})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise InputError(
                    f"{self.path}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})",
                    hint=f"give the split's folder, e.g. {self.path / next(iter(ds), 'SPLIT')}",
                )
            ds = ds["train"]
        schema = ds.features.arrow_schema  # a nested feature (a list, a dict) has no single pa_type of its own
        _check_string_column(self.path, self.text_field, ds.column_names, lambda n: schema.field(n).type)
        self._ds = ds.select_columns([self.text_field]).with_format("arrow")
        self.num_documents = len(ds)

    def documents(self) -> Iterator[str]:
        row = 0
        for table in self._ds.iter(batch_size=BATCH_ROWS):
            texts = _texts(self.path, table.column(0).combine_chunks(), row, self.text_field)
            row += len(texts)
            yield from texts


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


SOURCE_KINDS: tuple[SourceKind, ...] = (
    SourceKind("text", TextFile, suffixes=(".txt", ".md", ".rst"), streams=True),
    SourceKind("jsonl", JsonlFile, suffixes=(".jsonl",), streams=True),
    SourceKind("csv", CsvFile, suffixes=(".csv",), streams=True),
    SourceKind("parquet", ParquetSource, suffixes=(".parquet",)),
    SourceKind("hf-disk", SavedDataset, is_folder=is_saved_dataset),
)


TEXT_KIND = SOURCE_KINDS[0]


def kind_of(path: Path, text_globs: Sequence[str] = ()) -> SourceKind | None:
    """The kind that reads `path` (a file by suffix, its compression's stripped; a folder by its marker files), or
    None. A file whose name matches one of `text_globs` (`*.py`) is a text file whatever its suffix."""
    import fnmatch

    is_dir = path.is_dir()
    suffix = inner_suffix(path)
    for kind in SOURCE_KINDS:
        if kind.is_folder is not None:
            if is_dir and kind.is_folder(path):
                return kind
        elif not is_dir and suffix in kind.suffixes and (kind.streams or not compression(path)):
            return kind
    if not is_dir and any(fnmatch.fnmatch(path.name, g) for g in text_globs):
        return TEXT_KIND
    return None


def _known_suffixes() -> str:
    return " ".join(s for k in SOURCE_KINDS for s in k.suffixes) + " (" + " ".join(COMPRESSIONS) + " compressed)"


def _unknown(p: Path) -> InputError:
    if compression(p) and inner_suffix(p) in (".parquet",):
        return InputError(f"{p}: a compressed parquet file (parquet compresses inside): decompress it first")
    return InputError(
        f"{p}: unknown kind of input {p.suffix or '(no suffix)'!r}",
        hint=f"known: {_known_suffixes()} and datasets folders (save_to_disk); other text files: --glob '*{p.suffix}'",
    )


def expand(inputs: Sequence[str | Path], text_globs: Sequence[str] = ()) -> list[tuple[Path, SourceKind]]:
    """Inputs as given, folders expanded to the sources under them, sorted (the order never depends on the disk).

    A folder that is itself a source (a saved dataset) is one source, never expanded; inside folders, files of
    unknown suffixes and hidden entries (".git", a prepare's ".OUT.tmp-*") are skipped; a file named explicitly must
    be of a known kind, or match one of `text_globs` (read as text)."""
    out: list[tuple[Path, SourceKind]] = []
    for p in map(Path, inputs):
        if not p.exists():
            raise InputError(f"{p}: no such file or folder")
        kind = kind_of(p, text_globs)
        if kind is not None:
            out.append((p, kind))
        elif p.is_dir():
            found = _walk(p, text_globs)
            if not found:
                raise InputError(
                    f"{p}: no documents found in this folder (known: {_known_suffixes()}, datasets folders)"
                )
            out += found
        else:
            raise _unknown(p)
    if not out:
        raise InputError("no inputs given")
    return out


def _walk(root: Path, text_globs: Sequence[str] = ()) -> list[tuple[Path, SourceKind]]:
    found: list[tuple[Path, SourceKind]] = []
    for folder, dirs, files in os.walk(root):
        d = Path(folder)
        keep = []
        for name in dirs:
            if name.startswith("."):
                continue
            kind = kind_of(d / name)
            if kind is not None:
                found.append((d / name, kind))  # a dataset folder: one source, not descended into
            else:
                keep.append(name)
        dirs[:] = keep
        for name in files:
            if not name.startswith("."):
                kind = kind_of(d / name, text_globs)
                if kind is not None:
                    found.append((d / name, kind))
    return sorted(found, key=lambda e: e[0])


def open_sources(inputs: Sequence[str | Path], text_field: str, text_globs: Sequence[str] = ()) -> list[Source]:
    """Expand and open every input (so that a missing column in the last file is found before any work)."""
    return [kind.open(path, text_field) for path, kind in expand(inputs, text_globs)]
