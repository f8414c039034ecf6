"""Read one rank's slice of checkpoint tensors: from safetensors files (memory-mapped) or an in-memory state dict.

`safe_open(...).get_slice(name)[a:b]` copies only the requested bytes out of the mapped file, so a rank
never holds a full weight, only its shard.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import attrs
import torch
from safetensors import safe_open

from mstar_core.checkpoint.errors import CheckpointError


@attrs.frozen
class Piece:
    """Checkpoint tensor `name`, indices `[start, stop)` along `dim` (`dim` None: the whole tensor)."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


@attrs.frozen
class Stack:
    """One tensor per row of `rows` (its pieces concatenated along dim 0), stacked along a new dim 0.

    A fused expert tensor `[E, 2I, H]` read from per-expert checkpoint tensors: one row per expert this rank holds.
    """

    rows: tuple[tuple[Piece, ...], ...]

    @property
    def names(self) -> list[str]:
        return [p.name for row in self.rows for p in row]


Entry = list[Piece] | Stack  # what one parameter of a split model is read from


class SliceSource(Protocol):
    """Something that hands out slices of named checkpoint tensors."""

    def read(self, piece: Piece) -> torch.Tensor: ...


def _index(tensor_slice, piece: Piece):
    if piece.dim is None:
        return tensor_slice[:]
    return tensor_slice[(slice(None),) * piece.dim + (slice(piece.start, piece.stop),)]


class SafetensorsSlices:
    """`model.safetensors` or the shards of `model.safetensors.index.json`, read slice by slice; close() when done."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (OSError, ValueError, KeyError) as exc:
                    raise CheckpointError(f"{index}: not a valid checkpoint index ({exc})") from None
                files = sorted({path / shard for shard in weight_map.values()})
            elif (path / "model.safetensors").is_file():
                files = [path / "model.safetensors"]
            else:
                raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
        else:
            files = [path]
        self.where = str(path)
        self.bytes_read = 0  # what this rank copied out of the mapped files (its shard, never the full set)
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                self._handles[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, piece: Piece) -> torch.Tensor:
        tensor = _index(self._handle(piece.name).get_slice(piece.name), piece)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _handle(self, name: str):
        try:
            return self._handles[name]
        except KeyError:
            raise CheckpointError(f"{self.where}: no tensor {name!r} in the checkpoint") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SafetensorsSlices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StateDictSlices:
    """Slices of tensors already in memory (a full model's `state_dict()`), for splitting a loaded model."""

    def __init__(self, state: Mapping[str, torch.Tensor], where: str = "state dict"):
        self.state, self.where = state, where

    def read(self, piece: Piece) -> torch.Tensor:
        try:
            tensor = self.state[piece.name]
        except KeyError:
            raise CheckpointError(f"{self.where}: no tensor {piece.name!r}") from None
        return _index(tensor, piece).clone() if piece.dim is not None else tensor.clone()


def read_pieces(source: SliceSource, pieces: Entry, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The pieces read and concatenated along dim 0 (a fused q/k/v or gate/up shard) or returned alone; a `Stack` stacked."""
    if isinstance(pieces, Stack):
        return torch.stack([read_pieces(source, list(row), dtype) for row in pieces.rows])
    parts = [source.read(p) for p in pieces]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out if dtype is None else out.to(dtype)


def entry_names(pieces: Entry) -> list[str]:
    """The checkpoint tensors an entry reads (for error messages)."""
    return pieces.names if isinstance(pieces, Stack) else [p.name for p in pieces]
