"""What a plan's data is, checked before any job starts (torch-free): the files behind `data.paths`, the tokenizer
a prepared folder was made with, and `llmctl plan --data`'s reading of a path into a plan's `data:` section.

The engine checks the same things again at start (llmctl.engine.data, from these functions): a plan written on a
laptop may name paths that exist only on the cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmctl.data.format import open_prepared, read_meta
from llmctl.data.tokenizer import load_tokenizer
from llmctl.errors import InputError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def expand_paths(paths: Sequence[str], key: str = "data.paths") -> list[Path]:
    """Files as given, folders expanded to their text files (sorted, so the order never depends on the disk)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        elif p.is_file():
            out.append(p)
        else:
            raise InputError(f"{key}: {str(p)!r} does not exist")
    if not out:
        raise InputError(f"{key}: no text files found in {list(paths)}")
    return out


def check_tokenizer(meta_tokenizer: Any, path: str, expected: Sequence[tuple[str, str]]) -> None:
    """Refuse prepared data whose tokenizer is not the one the plan names (data.tokenizer, or the tokenizer that
    ships in model.weights): same vocabulary size is not enough, the ids must mean the same text."""
    if not isinstance(meta_tokenizer, dict) or not meta_tokenizer.get("fingerprint"):
        return  # no fingerprint recorded: only the vocabulary size can be checked
    for key, folder in expected:
        mine = load_tokenizer(folder).fingerprint()
        if mine != meta_tokenizer["fingerprint"]:
            raise InputError(
                f"data.paths: {path} was prepared with tokenizer {meta_tokenizer.get('name')!r} "
                f"(fingerprint {str(meta_tokenizer['fingerprint'])[:12]}), not the {key} {folder!r} "
                f"(fingerprint {mine[:12]})",
                hint="prepare the data again with --tokenizer set to the model's tokenizer",
            )


def has_tokenizer(folder: str | None) -> bool:
    return bool(folder) and any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)  # type: ignore[arg-type]


def expected_tokenizers(tokenizer: str | None, weights: str | None) -> list[tuple[str, str]]:
    """The tokenizers prepared data must have been made with: data.tokenizer, and the one in model.weights."""
    out = [("data.tokenizer", tokenizer)] if tokenizer else []
    if weights and has_tokenizer(weights):
        out.append(("tokenizer of model.weights", weights))
    return out


def check_vocab(vocab_size: int, model_vocab: int, what: str) -> None:
    if vocab_size > model_vocab:
        raise InputError(
            f"data: the tokenizer of {what} has {vocab_size} tokens but the model's vocabulary is {model_vocab}",
            hint="set model.overrides.vocab_size or use a matching tokenizer",
        )


def plan_data(
    paths: Sequence[str],
    model_vocab: int,
    tokenizer: str | None = None,
    weights: str | None = None,
    jsonl_field: str = "text",
) -> tuple[dict[str, Any], str]:
    """`llmctl plan --data PATH...` -> the plan's `data:` section and one line saying what it is, checked now: the
    paths exist; a folder made by `llmctl data prepare` is read as tokens (its val split, when it has tokens, as the
    validation set), its tokenizer compared by fingerprint with --tokenizer and the model folder's; text and jsonl
    files (or folders of them) are read as text, tokenized at start with --tokenizer, else the model folder's
    tokenizer, else the built-in bytes; in every case the tokenizer's vocabulary must fit the model's."""
    paths = [str(p) for p in paths]
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise InputError(f"--tokenizer {tokenizer}: not a folder (a local Hugging Face tokenizer folder)")
    prepared = [p for p in paths if (Path(p) / "meta.json").is_file()]
    if prepared:
        if len(paths) != 1:
            raise InputError(
                f"--data: {prepared[0]} is a prepared folder; give it alone (one folder made by `llmctl data "
                "prepare`), or prepare all the sources into one"
            )
        meta = read_meta(paths[0])
        open_prepared(paths[0], "train")  # the shards are there, of the sizes the metadata says
        check_tokenizer(meta.get("tokenizer"), paths[0], expected_tokenizers(tokenizer, weights))
        check_vocab(int(meta.get("vocab_size", 0)), model_vocab, paths[0])
        split = meta["splits"].get("val") or {}
        has_val = int(split.get("tokens", 0) or 0) > 0
        train = int((meta["splits"].get("train") or {}).get("tokens", 0) or 0)
        name = (meta.get("tokenizer") or {}).get("name")
        section: dict[str, Any] = {"kind": "tokens", "paths": paths, "tokenizer": tokenizer}
        if has_val:
            section["val"] = "split"
        line = f"{paths[0]}: prepared, {train:,} train tokens ({name}){', val split' if has_val else ''}"
        packed = (meta["splits"].get("train") or {}).get("packed")
        if packed:  # instruction data: the engine refuses a training.seq_len other than the packs' length
            s = packed.get("seq_len")
            line += (
                f"; {packed.get('examples', 0):,} examples packed in sequences of {s} (training.seq_len must be {s})"
            )
        return section, line
    files = expand_paths(paths, "--data")
    tok_folder = tokenizer or (weights if has_tokenizer(weights) else None)
    tok = load_tokenizer(tok_folder)
    check_vocab(tok.vocab_size, model_vocab, f"--data ({tok.name})")
    size = sum(f.stat().st_size for f in files)
    section = {"kind": "text", "paths": paths, "tokenizer": tok_folder, "jsonl_field": jsonl_field}
    line = f"{len(files)} text file{'s' if len(files) != 1 else ''} ({size / 2**20:.1f} MiB), tokenizer {tok.name}"
    return section, line
