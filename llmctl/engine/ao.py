"""torchao, the optional extra `llmctl[fp8]` behind float8 training (llmctl.engine.float8) and 8-bit Adam states
(llmctl.engine.adamw_states), imported in one place."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from llmctl.errors import InputError

HINT = "pip install 'llmctl[fp8]'"
QUIET = ("torchao", "torch.utils._pytree")
"""On a CPU machine torchao logs each CUDA extension it cannot load, and torch a deprecation of torchao's pytree
registrations: both through `logging`, both noise for llmctl."""


@contextmanager
def quiet_torchao() -> Iterator[None]:
    """The QUIET loggers at ERROR inside the block: around any import that may import torchao, ours or one a library
    makes (transformers' modeling_utils imports torchao for its quantizer whenever torchao is installed)."""
    quiet = [logging.getLogger(n) for n in QUIET]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)


def import_torchao(module: str, needed_for: str) -> ModuleType:
    """`module` (torchao.float8, torchao.optim), quietly, or one line saying what needs it and naming the extra."""
    with quiet_torchao():
        try:
            importlib.import_module("torchao")  # first: a submodule found in sys.modules would hide a missing package
            return importlib.import_module(module)
        except ImportError as e:
            raise InputError(f"{needed_for} needs torchao ({e})", hint=HINT) from None
