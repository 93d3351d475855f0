"""The measurements of llmctl.measure.fake on disk: `<cache_dir>/<config_hash>.json`, one file per config.

The key covers the config, the method (MEASURE_VERSION) and the torch and transformers versions, all read without
importing torch: a cache hit stays cheap. A file that is unreadable or not a measurement of its key is measured
again; one that cannot be written costs a measurement next time, never this result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from llmctl.errors import one_line

MEASURE_VERSION = 2
"""Bump when the method changes: it is part of the cache key."""

CACHE_ENV = "LLMCTL_CACHE_DIR"
RESULT_KEYS = (
    "version",
    "model_type",
    "config_hash",
    "total_params",
    "embedding_params",
    "head_params",
    "layers",
    "saved",
    "head_saved",
    "head_saved_checkpointed",
    "attention_used",
    "seconds",
)
"""What every measurement holds (fit_error only when a fit missed): a cached file without one is re-measured."""

log = logging.getLogger("llmctl.measure")


def default_cache_dir() -> Path:
    """$LLMCTL_CACHE_DIR, else $XDG_CACHE_HOME/llmctl/measured, else ~/.cache/llmctl/measured."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "llmctl" / "measured"


def config_hash(cfg: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of cfg, MEASURE_VERSION and the torch and transformers versions (read from the
    installed packages' metadata: a cache hit never imports torch)."""
    payload = {
        "config": cfg,
        "measure_version": MEASURE_VERSION,
        "torch": _package_version("torch"),
        "transformers": _package_version("transformers"),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def read(path: Path, key: str) -> dict | None:
    """The cached result, or None when there is none or it is unreadable (a crash mid-write, a hand edit)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError covers bad JSON and bad UTF-8
        log.warning("re-measuring: unreadable cache file %s (%s)", path, one_line(str(e)))
        return None
    ok = (
        isinstance(data, dict)
        and all(k in data for k in RESULT_KEYS)
        and data["version"] == MEASURE_VERSION
        and data["config_hash"] == key
    )
    if not ok:
        log.warning("re-measuring: cache file %s is not a measurement of this config", path)
        return None
    return data


def write(path: Path, result: dict) -> None:
    """Write atomically (a temporary file in the same folder, then os.replace): readers never see half a file. A
    cache that cannot be written costs a re-measurement next time, not this result."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(result, f, indent=1, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("could not cache the measurement in %s: %s", path, one_line(str(e)))
