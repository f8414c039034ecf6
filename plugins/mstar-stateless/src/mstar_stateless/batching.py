"""Turning several invocations' inputs into one batched call and its outputs back into per-call results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F


def batch_key(inputs: Mapping[str, Any], pad_dim: int | None) -> tuple | None:
    """Calls with equal keys can share one forward; None means the call cannot be stacked at all."""
    key = []
    for name in sorted(inputs):
        value = inputs[name]
        if not isinstance(value, torch.Tensor):
            return None
        shape = list(value.shape)
        if pad_dim is not None:
            if not -len(shape) <= pad_dim < len(shape):
                return None
            shape[pad_dim] = -1  # padded to the longest
        key.append((name, tuple(shape), value.dtype, value.device))
    return tuple(key)


def pad_and_stack(
    values: Sequence[torch.Tensor], pad_dim: int | None, pad_value: float = 0.0
) -> tuple[torch.Tensor, list[int] | None]:
    """Stack along a new leading batch dim, padding `pad_dim` to the longest; returns the original lengths."""
    if pad_dim is None:
        return torch.stack(list(values)), None
    dim = pad_dim % values[0].dim()
    lengths = [v.shape[dim] for v in values]
    longest = max(lengths)
    padded = []
    for v, n in zip(values, lengths, strict=True):
        if n < longest:
            # F.pad takes (left, right) pairs starting from the last dim
            spec = [0, 0] * (v.dim() - 1 - dim) + [0, longest - n]
            v = F.pad(v, spec, value=pad_value)
        padded.append(v)
    return torch.stack(padded), lengths


def _as_dict(result: Any, outputs: Sequence[str]) -> dict[str, Any]:
    if isinstance(result, Mapping):
        missing = [o for o in outputs if o not in result]
        if missing:
            raise ValueError(f"module returned {sorted(result)} but the node declares outputs {list(outputs)}")
        return {o: result[o] for o in outputs}
    if isinstance(result, tuple | list):
        if len(result) != len(outputs):
            raise ValueError(f"module returned {len(result)} values for {len(outputs)} declared outputs {list(outputs)}")
        return dict(zip(outputs, result, strict=True))
    if len(outputs) != 1:
        raise ValueError(f"module returned one value but the node declares outputs {list(outputs)}")
    return {outputs[0]: result}


def split_outputs(
    result: Any,
    outputs: Sequence[str],
    count: int,
    lengths: list[int] | None,
    pad_dim: int | None,
    padded_len: int | None,
) -> list[dict[str, Any]]:
    """Split batched outputs along dim 0; with padding, trim `pad_dim` in proportion to each input's length.

    Proportional trimming is exact for the usual codecs and encoders, whose output length along
    the padded axis is a fixed multiple (or fraction) of the input's.
    """
    named = _as_dict(result, outputs)
    per_call: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != count:
            raise ValueError(f"batched output '{name}' must be a tensor with a leading batch dim of {count}")
        for i in range(count):
            item = value[i]
            if lengths is not None and pad_dim is not None and item.dim() > 0:
                dim = pad_dim % item.dim()
                keep = item.shape[dim] * lengths[i] // padded_len
                item = item.narrow(dim, 0, keep)
            per_call[i][name] = item
    return per_call


def call_single(module: Any, inputs: Mapping[str, Any], outputs: Sequence[str]) -> dict[str, Any]:
    """Run one invocation on its own (no batch dim added)."""
    return _as_dict(module(**inputs), outputs)
