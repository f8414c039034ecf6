"""Where checkpoint tensors come from: safetensors (single or sharded) and `weights_only` torch files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from mstar_core.checkpoint.errors import CheckpointError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"


class TensorSource(Protocol):
    """A set of named tensors read one at a time (so a shard is never fully materialized twice)."""

    where: str

    def __len__(self) -> int: ...

    def items(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def _read_index(path: Path) -> dict[str, list[str]]:
    """Shard file -> tensor names, from a HF `*.index.json`."""
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: not a valid checkpoint index ({exc})") from None
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    for shard in shards:
        if not (path.parent / shard).is_file():
            raise CheckpointError(f"{path} lists shard {shard!r}, which is not in {path.parent}")
    return shards


class SafetensorsSource:
    """`model.safetensors`, or the shards named by `model.safetensors.index.json`, read lazily."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            index = path / SAFETENSORS_INDEX
            self.where = str(path)
            if index.is_file():
                self.shards = {path / s: names for s, names in _read_index(index).items()}
            elif (path / SAFETENSORS).is_file():
                self.shards = {path / SAFETENSORS: None}
            else:
                raise CheckpointError(f"{path}: no {SAFETENSORS} or {SAFETENSORS_INDEX}")
        else:
            self.where, self.shards = str(path), {path: None}
        self._count = sum(len(n) if n is not None else self._count_file(p) for p, n in self.shards.items())

    @staticmethod
    def _count_file(path: Path) -> int:
        with safe_open(str(path), framework="pt") as f:
            return len(list(f.keys()))

    def __len__(self) -> int:
        return self._count

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for shard, names in self.shards.items():
            with ExitStack() as stack:
                f = stack.enter_context(safe_open(str(shard), framework="pt"))
                for name in names if names is not None else f.keys():
                    yield name, f.get_tensor(name)


class TorchFileSource:
    """`pytorch_model.bin` / `.pt` files, loaded with `weights_only=True` (never arbitrary pickle)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.where = str(path)
        if path.is_dir():
            index = path / TORCH_BIN_INDEX
            self.files = [path / s for s in _read_index(index)] if index.is_file() else [path / TORCH_BIN]
        else:
            self.files = [path]
        self._loaded = [self._load(f) for f in self.files]

    @staticmethod
    def _load(path: Path) -> dict[str, torch.Tensor]:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises UnpicklingError, RuntimeError, OSError...
            raise CheckpointError(f"{path}: cannot load with weights_only=True ({exc})") from None
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
        return state

    def __len__(self) -> int:
        return sum(len(s) for s in self._loaded)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for state in self._loaded:
            yield from state.items()


def open_checkpoint(path: str | Path) -> TensorSource:
    """Pick the source for a checkpoint directory or file: safetensors first, then torch files."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if path.is_file():
        if path.suffix == ".safetensors":
            return SafetensorsSource(path)
        if path.suffix in (".bin", ".pt", ".pth"):
            return TorchFileSource(path)
        raise CheckpointError(f"{path}: unknown weight file type (use .safetensors, .bin or .pt)")
    if (path / SAFETENSORS).is_file() or (path / SAFETENSORS_INDEX).is_file():
        return SafetensorsSource(path)
    if (path / TORCH_BIN).is_file() or (path / TORCH_BIN_INDEX).is_file():
        return TorchFileSource(path)
    raise CheckpointError(f"{path}: no weights found (expected {SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN})")
