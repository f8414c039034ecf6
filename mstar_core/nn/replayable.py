"""What a recorded step may assume of a module (`mstar_kvcache.replay`), said through calls of this module.

A replay runs a recorded step's kernels on the weights as they were recorded, and stands for the module's
whole forward. So it needs to know two things, asked here rather than read out of torch's internals:

* `splits_forward(module)`: whether calling the module runs exactly `layer_inputs`, `run_layers` (and
  `layer_outputs`) as its class defines them: the class that defines `forward` defines the split with it,
  and no forward hook or pre-hook is registered on the module (a replay would skip them).
* `weights_generation(module)`: a counter that moves whenever the module's weights may have changed, so a
  recording made under one generation is not replayed under another. It moves when `load_state_dict` runs
  on the module or on any of its submodules (checkpoint loaders go through it), when a parameter or a
  submodule is assigned anywhere in it (`module.weight = ...`, `load_state_dict(assign=True)`), when a
  `PackedLinear` in it repacks, and when `weights_changed(module)` is called. A loader that writes weights
  in place by other means (`param.copy_()` under `no_grad`) must call `weights_changed`: torch keeps its own
  in-place counter private (`Tensor._version`), so this counter is what M* owns and bumps instead.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)


class WeightsGeneration:
    """How many times the weights of one module (and its submodules) may have changed since it was watched."""

    __slots__ = ("__weakref__", "value")

    def __init__(self) -> None:
        self.value = 0


# every watched module (a root and each of its submodules) -> the generations it counts towards (one per watched
# root it sits under); weak, so watching keeps no module alive
_COUNTS: weakref.WeakKeyDictionary[nn.Module, list[WeightsGeneration]] = weakref.WeakKeyDictionary()
_ROOTS: weakref.WeakKeyDictionary[nn.Module, WeightsGeneration] = weakref.WeakKeyDictionary()
_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules whose load_state_dict post hook is registered
_GLOBAL_HOOKS: list[Any] = []


def weights_changed(module: nn.Module) -> None:
    """Say that `module`'s weights (or those of a submodule of it) changed: recordings over them are stale."""
    for generation in _COUNTS.get(module, ()):
        generation.value += 1


def _after_load(module: nn.Module, incompatible_keys: Any) -> None:
    weights_changed(module)


def _parameter_registered(module: nn.Module, name: str, param: Any) -> None:
    weights_changed(module)  # (returns None: the registration goes on unchanged)


def _module_registered(module: nn.Module, name: str, child: Any) -> None:
    generations = _COUNTS.get(module)
    if generations:  # a submodule added to a watched module is watched with it from now on
        if isinstance(child, nn.Module):
            for generation in generations:
                _watch(child, generation)
        weights_changed(module)


def _watch(module: nn.Module, generation: WeightsGeneration) -> None:
    for sub in module.modules():
        counts = _COUNTS.setdefault(sub, [])
        if generation not in counts:
            counts.append(generation)
        if sub not in _HOOKED:  # load_state_dict runs each submodule's post hooks as it loads into it
            sub.register_load_state_dict_post_hook(_after_load)
            _HOOKED.add(sub)


def weights_generation(module: nn.Module) -> WeightsGeneration:
    """The generation counter of `module`'s weights (watched from this first call on)."""
    generation = _ROOTS.get(module)
    if generation is not None:
        return generation
    if not _GLOBAL_HOOKS:  # assignments anywhere reach these; they ignore modules nobody watches
        _GLOBAL_HOOKS.append(register_module_parameter_registration_hook(_parameter_registered))
        _GLOBAL_HOOKS.append(register_module_module_registration_hook(_module_registered))
    generation = _ROOTS[module] = WeightsGeneration()
    _watch(module, generation)
    return generation


def splits_forward(module: Any) -> bool:
    """Whether calling `module` runs its split forward and nothing else (see the module docstring).

    (A subclass that overrides `forward` alone no longer runs as its parent's split says: it opts out.)
    """
    for owner in type(module).__mro__:
        if "forward" in vars(owner):
            if not ("layer_inputs" in vars(owner) and "run_layers" in vars(owner)):
                return False
            break
    else:
        return False
    return not (isinstance(module, nn.Module) and has_forward_hooks(module))


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether a forward hook or pre-hook is registered on `module` itself.

    torch lists a module's hooks nowhere public, so this is the one place M* reads the dicts `register_forward_hook`
    and `register_forward_pre_hook` fill (tests/nn/test_replayable.py pins it against those calls).
    """
    return bool(vars(module).get("_forward_hooks")) or bool(vars(module).get("_forward_pre_hooks"))

