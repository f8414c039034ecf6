"""Write a state dict in Hugging Face layout (`config.json` + safetensors, sharded on request)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from mstar_core.checkpoint.sources import SAFETENSORS, SAFETENSORS_INDEX


def _shards(state: Mapping[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def save_hf_checkpoint(
    weights: nn.Module | Mapping[str, torch.Tensor],
    directory: str | Path,
    config: Mapping[str, Any] | None = None,
    *,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    extra_files: Mapping[str, str | Mapping[str, Any]] | None = None,
) -> Path:
    """Save `weights` to `directory` as HF does; shards of at most `max_shard_bytes` get an index file.

    `extra_files` maps a file name to text or a JSON-able mapping (tokenizer_config.json, ...).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = weights.state_dict() if isinstance(weights, nn.Module) else weights
    # safetensors refuses shared storage (tied weights), so every tensor gets its own contiguous copy.
    state = {
        n: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().cpu().contiguous().clone()
        for n, t in state.items()
    }
    for stale in [*directory.glob("model*.safetensors"), directory / SAFETENSORS_INDEX]:
        stale.unlink(missing_ok=True)
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(directory / SAFETENSORS), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(dict(config), indent=2))
    for name, content in (extra_files or {}).items():
        text = content if isinstance(content, str) else json.dumps(dict(content), indent=2)
        (directory / name).write_text(text)
    return directory
