"""A process that hosts some of a model's nodes holds only their weights: the rest stay on the meta device.

Models build the modules of nodes a process does not host on the meta device themselves
(`LoadOptions.device_for`). `release_unhosted` is the backstop for a model that ignores
`LoadOptions.nodes`: after loading, it moves the other nodes' modules to the meta device, unless they
share a tensor with a hosted node (one module serving several nodes). `resident_parameters` counts
what a process really holds, so tests and gauges can prove it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("mstar.checkpoint")


def node_module(node: Any) -> nn.Module | None:
    """The module a graph node wraps, or None (function nodes)."""
    if getattr(node, "module", None) is None:
        return None
    module = node.module()
    return module if isinstance(module, nn.Module) else None


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def resident_parameters(modules: Iterable[nn.Module | None]) -> dict[str, int]:
    """Parameters (elements) and bytes of parameters and buffers these modules hold off the meta device.

    Each tensor counts once however many modules share it.
    """
    seen: set[int] = set()
    params = nbytes = 0
    for module in modules:
        if module is None:
            continue
        for kind, tensors in (("p", module.parameters()), ("b", module.buffers())):
            for t in tensors:
                if t.is_meta or id(t) in seen:
                    continue
                seen.add(id(t))
                nbytes += t.numel() * t.element_size()
                if kind == "p":
                    params += t.numel()
    return {"parameters": params, "parameter_bytes": nbytes}


def release_unhosted(graph: Any, hosted: Iterable[str]) -> list[str]:
    """Move the modules of nodes not in `hosted` to the meta device; returns the nodes released.

    A module sharing any tensor with a hosted node's module stays as it is (freeing it would take
    the hosted node's weights with it).
    """
    hosted = set(hosted)
    keep = {id(t) for name in hosted if name in graph.nodes
            for t in _tensors(node_module(graph.nodes[name]) or nn.Module())}
    released = []
    for name, node in graph.nodes.items():
        module = node_module(node)
        if name in hosted or module is None:
            continue
        tensors = list(_tensors(module))
        if not tensors or all(t.is_meta for t in tensors) or any(id(t) in keep for t in tensors):
            continue
        module.to("meta")
        released.append(name)
    if released:
        log.info("released the weights of nodes this process does not host: %s (the model loaded them anyway)",
                 ", ".join(released))
    return released
