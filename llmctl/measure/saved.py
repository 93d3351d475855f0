"""The saved-bytes harness: the bytes autograd saves for backward in a forward, once per storage, by region.

Every tensor autograd saves (`torch.autograd.graph.saved_tensors_hooks`) is counted once per storage: views such as
the one input q/k/v all save share it. Storages are told apart by `storage_key`, the address of the StorageImpl,
which fake tensors (no data_ptr) have too, and held by weak reference: a storage freed during forward (the saved
tensors of a result nobody uses) is not held for backward, and its key may come back for a new one. What is counted
is what is still alive when asked: ask while the forward's output keeps the autograd graph alive.

Each saved storage is charged to a region: by default the one current when it was first saved (`region`, which
`track` sets to a module's index while it runs, else OUTSIDE); with `by_creator`, the one current when an op created
it, so each decoder layer owns its output whoever saves it (llmctl.measure.forward, on fake tensors).

Used by llmctl.measure.forward and by the memory model's tests on real CPU tensors (tests/plan/test_memory_measured.py,
tests/plan/test_families_measured.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

OUTSIDE = "outside"
"""The region of everything saved (or, by creator, created) outside the tracked modules."""


def storage_key(t: torch.Tensor) -> int:
    """A storage's identity that works for fake tensors (no data_ptr): the address of its StorageImpl, shared by
    all views of it."""
    return StorageWeakRef(t.untyped_storage()).cdata


def _live(entry: tuple | None) -> tuple | None:
    """A table entry (weak reference first) whose storage is still alive, else None."""
    return entry if entry is not None and not entry[0].expired() else None


class SavedBytes:
    """A context manager: while entered, what autograd saves for backward is recorded (module docstring).

    `exclude`: tensors that are not activations (parameters, buffers, the batch); `key` identifies storages
    (storage_key; a real run may use data_ptr, `id` counts tensor objects instead)."""

    def __init__(
        self,
        exclude: Iterable[torch.Tensor] = (),
        *,
        key: Callable[[torch.Tensor], int] = storage_key,
        by_creator: bool = False,
    ) -> None:
        self.region: Hashable = OUTSIDE
        self._key = key
        self._by_creator = by_creator
        self._excluded: dict[int, tuple[StorageWeakRef]] = {}
        self._created: dict[int, tuple[StorageWeakRef, Hashable]] = {}  # storage key -> (weak ref, creator's region)
        self._saved: dict[int, tuple[StorageWeakRef, Hashable, int]] = {}  # storage key -> (weak ref, region, bytes)
        self._stack: contextlib.ExitStack | None = None
        for t in exclude:
            self.exclude(t)

    def exclude(self, t: torch.Tensor) -> None:
        """Never count t's storage. By weak reference too: a model may replace a buffer during forward (CTRL casts its
        position table), and the freed one's key may come back for an activation."""
        self._excluded[self._key(t)] = (StorageWeakRef(t.untyped_storage()),)

    def keep(self, t: torch.Tensor) -> None:
        """Count t's storage as saved for backward (once), unless excluded: what autograd saves, and what else holds
        a tensor until backward (a checkpointed layer's inputs)."""
        k = self._key(t)
        if _live(self._excluded.get(k)) is not None or _live(self._saved.get(k)) is not None:
            return
        storage = t.untyped_storage()
        if self._by_creator:
            creator = _live(self._created.get(k))
            where = creator[1] if creator is not None else OUTSIDE
        else:
            where = self.region
        self._saved[k] = (StorageWeakRef(storage), where, storage.nbytes())

    def _created_by(self, t: torch.Tensor) -> None:
        k = self._key(t)
        if _live(self._created.get(k)) is None:  # views keep their creator
            self._created[k] = (StorageWeakRef(t.untyped_storage()), self.region)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.keep(t)
        return t

    def track(self, modules: Sequence[Any], keep_inputs: bool = False) -> list[Any]:
        """Make `modules[i]` the region `i` while it runs (forward hooks); `keep_inputs` also keeps every tensor it is
        called with (a checkpointed layer holds them: positional ones through its saved inputs, keyword ones through
        the recompute closure). Returns the hook handles (`.remove()` them to stop)."""

        def enter(index: int) -> Callable[..., None]:
            def hook(module: Any, args: Any, kwargs: Any) -> None:
                self.region = index
                if keep_inputs:
                    for t in tree_leaves((args, kwargs)):
                        if isinstance(t, torch.Tensor):
                            self.keep(t)

            return hook

        def leave(module: Any, args: Any, output: Any) -> None:
            self.region = OUTSIDE

        handles = []
        for i, module in enumerate(modules):
            handles.append(module.register_forward_pre_hook(enter(i), with_kwargs=True))
            handles.append(module.register_forward_hook(leave))
        return handles

    def __enter__(self) -> SavedBytes:
        with contextlib.ExitStack() as stack:
            if self._by_creator:
                stack.enter_context(_Creators(self))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def by_region(self) -> dict[Hashable, int]:
        """Bytes of the saved storages still alive, by region."""
        out: dict[Hashable, int] = {}
        for ref, where, nbytes in self._saved.values():
            if not ref.expired():
                out[where] = out.get(where, 0) + nbytes
        return out

    def total(self) -> int:
        """Bytes of the saved storages still alive."""
        return sum(self.by_region().values())


def saved_per_block(model: Any, batch: int, seq: int, vocab: int, checkpointing: bool = False) -> dict[Hashable, int]:
    """Bytes of distinct storages each decoder block of a transformers causal LM saves for backward in one training
    forward of `batch` x `seq` random tokens (parameters and buffers excluded; non-reentrant activation checkpointing
    when asked); key "outside" for everything saved outside the blocks. Llama-like models keep their blocks in
    model.model.layers, GPT-2 in model.transformer.h."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    saved = SavedBytes([*model.parameters(), *model.buffers()])
    saved.track(model.model.layers if hasattr(model, "model") else model.transformer.h)
    ids = torch.randint(0, vocab, (batch, seq))
    with saved:
        loss = model(input_ids=ids, labels=ids).loss
    assert loss.requires_grad
    return saved.by_region()


class _Creators(TorchDispatchMode):
    """Records the region current when an op creates each storage (SavedBytes with by_creator)."""

    def __init__(self, owner: SavedBytes) -> None:
        super().__init__()
        self._owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._owner._created_by(t)
        return out
