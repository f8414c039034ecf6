"""`mstar_core.nn.replayable`: what a recorded step may assume of a module, asked through public calls."""

from __future__ import annotations

import copy

import torch
from torch import nn

from mstar_core.nn.packed import PackedLinear, pack_linears, packing_available
from mstar_core.nn.replayable import has_forward_hooks, splits_forward, weights_changed, weights_generation


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))

    def forward(self, x):
        return self.run_layers(self.layer_inputs(x), None)

    def layer_inputs(self, x):
        return (x,)

    def run_layers(self, inputs, context):
        return self.inner(inputs[0])


def test_every_way_weights_change_moves_the_generation():
    model = Split()
    generation = weights_generation(model)
    assert weights_generation(model) is generation  # one counter per module, however often it is asked
    seen = generation.value

    def moved() -> bool:
        nonlocal seen
        moved, seen = generation.value != seen, generation.value
        return moved

    state = {k: v * 2 for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # in place, the same tensors
    assert moved()
    model.inner[0].load_state_dict({k: v + 1 for k, v in model.inner[0].state_dict().items()})  # a submodule alone
    assert moved()
    model.load_state_dict(state, assign=True)
    assert moved()
    model.inner[1].weight = nn.Parameter(torch.ones(4))  # a parameter replaced
    assert moved()
    model.inner.append(nn.Linear(4, 4))  # a submodule added: watched from now on
    assert moved()
    model.inner[2].load_state_dict({k: v * 0 for k, v in model.inner[2].state_dict().items()})
    assert moved()
    with torch.no_grad():
        model.inner[0].weight.mul_(3)  # an in-place write that is no load: the writer says so
    weights_changed(model.inner[0])
    assert moved()
    model(torch.randn(2, 4))  # running it moves nothing
    assert not moved()


def test_a_repack_moves_the_generation():
    if not packing_available():
        return
    model = nn.Sequential(nn.Linear(8, 256))
    assert pack_linears(model, min_out=1) == 1
    layer = model[0]
    assert isinstance(layer, PackedLinear)
    generation = weights_generation(model)
    before = generation.value
    layer.pack()
    assert generation.value > before


def test_copies_and_unwatched_modules_count_apart():
    model = Split()
    generation = weights_generation(model)
    before = generation.value
    twin = copy.deepcopy(model)
    twin.load_state_dict(twin.state_dict())
    Split().load_state_dict(model.state_dict())
    assert generation.value == before
    assert weights_generation(twin) is not generation


def test_splits_forward_and_hooks():
    model = Split()
    assert splits_forward(model) and not has_forward_hooks(model)

    class Shifted(Split):
        def forward(self, x):
            return super().forward(x) + 1

    assert not splits_forward(Shifted())
    assert not splits_forward(nn.Linear(2, 2))
    handle = model.register_forward_hook(lambda module, args, out: out)
    assert has_forward_hooks(model) and not splits_forward(model)
    handle.remove()
    handle = model.register_forward_pre_hook(lambda module, args: None)
    assert has_forward_hooks(model) and not splits_forward(model)
    handle.remove()
    assert splits_forward(model)
    model.inner.register_forward_hook(lambda module, args, out: out)  # a submodule's hooks run inside the layers
    assert splits_forward(model)
