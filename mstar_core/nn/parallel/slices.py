"""Read one rank's slice of checkpoint tensors: from safetensors files (memory-mapped) or an in-memory state dict.

`safe_open(...).get_tensor(name)` maps the tensor without copying it. A rank's row slice (the output rows
of a column-parallel linear, vocabulary rows, whole experts) stays a view of the mapped file: only the pages
it covers are ever read, as the whole-model loader's weights are; a column slice (a row-parallel linear's
inputs) is copied out (it reads every page of that one tensor, file-backed, then holds only its shard).
Fused parameters (q/k/v, gate/up, stacked experts) are copied once into their final tensor. No rank ever
holds a full weight it does not own.
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

    def shape(self, name: str) -> list[int]: ...


def _index(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece as a view of `tensor` (its rows) or a contiguous copy (a slice along a later dim)."""
    if piece.dim is None:
        return tensor
    if piece.dim == 0:
        return tensor[piece.start:piece.stop]
    return tensor[(slice(None),) * piece.dim + (slice(piece.start, piece.stop),)].contiguous()


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
        tensor = _index(self._handle(piece.name).get_tensor(piece.name), piece)  # (a view of the mapping)
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

    def shape(self, name: str) -> list[int]:
        return list(self.state[name].shape)

    def read(self, piece: Piece) -> torch.Tensor:
        try:
            tensor = self.state[piece.name]
        except KeyError:
            raise CheckpointError(f"{self.where}: no tensor {piece.name!r}") from None
        return _index(tensor, piece).clone()


def read_pieces(source: SliceSource, pieces: Entry, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The pieces read and concatenated along dim 0 (a fused q/k/v or gate/up shard) or returned alone; a `Stack` stacked."""
    if isinstance(pieces, Stack):
        first = read_pieces(source, list(pieces.rows[0]), dtype)
        out = first.new_empty((len(pieces.rows), *first.shape))
        out[0] = first
        for i, row in enumerate(pieces.rows[1:], start=1):
            _fill(out[i], source, list(row))
        return out
    if len(pieces) == 1:
        out = source.read(pieces[0])
        return out if dtype is None else out.to(dtype)
    parts = [source.read(p) for p in pieces[:1]]  # (the first gives the dtype and trailing shape)
    rows = [_rows(source, p) for p in pieces]
    out = parts[0].new_empty((sum(rows), *parts[0].shape[1:]), dtype=dtype or parts[0].dtype)
    _fill(out, source, pieces, first=parts[0])
    return out


def _rows(source: SliceSource, piece: Piece) -> int:
    if piece.dim == 0:
        return piece.stop - piece.start
    return source.shape(piece.name)[0]


def _fill(out: torch.Tensor, source: SliceSource, pieces: list[Piece], first: torch.Tensor | None = None) -> None:
    """Copy the pieces, one after the other along dim 0, into `out` (converting dtype on the way)."""
    at = 0
    for i, piece in enumerate(pieces):
        part = first if i == 0 and first is not None else source.read(piece)
        out[at:at + part.shape[0]].copy_(part)
        at += part.shape[0]
    if at != out.shape[0]:
        raise CheckpointError(f"pieces {[p.name for p in pieces]} give {at} rows, expected {out.shape[0]}")


def entry_names(pieces: Entry) -> list[str]:
    """The checkpoint tensors an entry reads (for error messages)."""
    return pieces.names if isinstance(pieces, Stack) else [p.name for p in pieces]
