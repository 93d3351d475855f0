"""The saved-bytes harness (llmctl.measure.saved) on a toy model whose saved tensors are known by hand.

Two layers of Linear(8, 8) -> tanh on a (4, 8) fp32 batch: a Linear saves its input (and its weight, a parameter),
tanh saves its output; each is 4*8*4 = 128 bytes.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install 'llmctl[train]')")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from llmctl.measure.saved import OUTSIDE, SavedBytes, storage_key  # noqa: E402

ACT = 4 * 8 * 4


def toy() -> tuple[torch.nn.ModuleList, torch.Tensor]:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2))
    return layers, torch.randn(4, 8)


def forward(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    h = x * 2  # created outside the layers; saved by the first layer's Linear
    for layer in layers:
        h = layer(h)
    return h.sum()


def test_storage_key_identifies_a_storage_across_views():
    for mode in (FakeTensorMode(), torch.device("cpu")):
        with mode:
            x = torch.empty(8, 64)
            y = torch.empty(8, 64)
        assert storage_key(x) == storage_key(x[:2]) == storage_key(x.view(4, 128)) == storage_key(x.t())
        assert storage_key(x) != storage_key(y)


@pytest.mark.parametrize("by_creator", [False, True], ids=["by-saver", "by-creator"])
def test_bytes_by_region(by_creator):
    layers, x = toy()
    saved = SavedBytes([*layers.parameters(), x], by_creator=by_creator)
    handles = saved.track(layers)
    with saved:
        loss = forward(layers, x)
    for h in handles:
        h.remove()
    # x*2 is saved by layer 0: charged to its saver, or to the outside that created it. Layer 1's input, layer 0's
    # tanh output, was saved first by that tanh: layer 0's either way.
    if by_creator:
        assert saved.by_region() == {OUTSIDE: ACT, 0: ACT, 1: ACT}
    else:
        assert saved.by_region() == {0: 2 * ACT, 1: ACT}
    assert saved.total() == 3 * ACT
    assert loss.requires_grad


def test_parameters_and_the_batch_are_excluded_and_freed_storages_not_counted():
    layers, x = toy()
    with SavedBytes() as everything:
        loss = forward(layers, x)
    # Not excluded, a parameter saved counts: layer 1's weight, which its input's gradient needs (layer 0's input
    # needs none, so its weight is not saved).
    assert everything.total() == 3 * ACT + layers[1][0].weight.untyped_storage().nbytes()
    with SavedBytes(layers.parameters()) as saved:
        loss = forward(layers, x)
        unused = layers[0][0](x * 3)  # saves x*3, freed with its graph: not held for backward
        del unused
    assert saved.total() == 3 * ACT
    assert loss.requires_grad


def test_kept_inputs_count_once():
    layers, x = toy()
    saved = SavedBytes(layers.parameters())
    saved.track(layers, keep_inputs=True)
    with saved:
        loss = forward(layers, x)
    assert saved.by_region() == {0: 2 * ACT, 1: ACT}  # the inputs the Linears save anyway
    assert loss.requires_grad
