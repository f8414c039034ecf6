"""Build a module on the meta device, then fill it from a checkpoint source in one validated pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from tqdm.auto import tqdm

from mstar_core.checkpoint.errors import CheckpointError, WeightMismatchError
from mstar_core.checkpoint.mapping import WeightMapping
from mstar_core.checkpoint.meta import on_meta
from mstar_core.checkpoint.sources import TensorSource

M = TypeVar("M", bound=nn.Module)


def _convert(tensor: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    if tensor.is_floating_point():
        tensor = tensor.to(dtype=dtype or want.dtype)
    return tensor.to(device).contiguous()


def load_weights(
    module: M,
    source: TensorSource,
    mapping: WeightMapping | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> M:
    """Assign every tensor of `module.state_dict()` from `source` (renamed by `mapping`).

    Floating tensors become `dtype` (default: the dtype the module declared). Raises
    `WeightMismatchError` listing all missing, unexpected and mis-shaped names at once.
    With `device="meta"` nothing is read: the module keeps its shapes and no memory (a serving
    process whose nodes all run in workers needs the graph, not the weights; workers load them).
    """
    mapping = mapping or WeightMapping()
    device = torch.device(device)
    if device.type == "meta":
        return module.to(device=device, dtype=dtype) if dtype is not None else module.to(device)
    expected = module.state_dict(keep_vars=True)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    mis_shaped: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def accept(name: str, tensor: torch.Tensor) -> None:
        want = expected.get(name)
        if want is None or name in state:
            unexpected.append(name if want is None else f"{name} (duplicate)")
        elif tuple(tensor.shape) != tuple(want.shape):
            mis_shaped.append((name, tuple(tensor.shape), tuple(want.shape)))
        else:
            state[name] = _convert(tensor, want, dtype, device)

    bar = tqdm(total=len(source), desc=f"loading {source.where}", unit="tensor", disable=not progress, leave=False)
    with bar:
        for raw_name, tensor in source.items():
            for name, mapped in mapping(raw_name, tensor):
                accept(name, mapped)
            bar.update()
        for name, mapped in mapping.flush():
            accept(name, mapped)
    missing = [name for name in expected if name not in state and not any(m[0] == name for m in mis_shaped)]
    if missing or unexpected or mis_shaped:
        raise WeightMismatchError(source.where, missing, unexpected, mis_shaped)
    module.load_state_dict(state, assign=True, strict=True)
    leftover = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftover:
        raise CheckpointError(
            f"after loading {source.where}, these tensors are still on the meta device (not in the state dict): "
            + ", ".join(leftover)
        )
    return module


def build_and_load(
    factory: Callable[[], M],
    source: TensorSource,
    mapping: WeightMapping | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> M:
    """Construct `factory()` on the meta device (no memory, no random init), then load it; returns it in eval mode."""
    with on_meta():
        module = factory()
    return load_weights(module, source, mapping, dtype=dtype, device=device, progress=progress).eval()
