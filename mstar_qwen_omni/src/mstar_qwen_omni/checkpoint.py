"""Qwen3-Omni checkpoints: the published layout (sharded safetensors + index, `thinker.*`, `talker.*`,
`code2wav.*`, experts stored one module per expert) read into `QwenOmni`, and written back in that layout.

The Thinker's and the Talker's per-expert weights are fused at load (`mlp.experts.E.{gate,up,down}_proj`
-> `mlp.experts.{gate_up_proj, down_proj}`), each with its own expert count; `expert_layout` does the
reverse for writers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from mstar_core.checkpoint import (
    CheckpointError,
    ExpertFusion,
    WeightMapping,
    build_and_load,
    open_checkpoint,
    read_config,
    save_hf_checkpoint,
)
from mstar_qwen_omni.code2wav import Code2Wav
from mstar_qwen_omni.config import OmniConfig
from mstar_qwen_omni.talker import Talker
from mstar_qwen_omni.thinker import Thinker

_DERIVED = re.compile(r"(\.rotary_emb\.inv_freq|\.code_offset|\.positional_embedding)$")


class QwenOmni(nn.Module):
    """The three parts under their checkpoint prefixes; `thinker` only when audio output is disabled."""

    def __init__(self, cfg: OmniConfig, with_audio: bool = True):
        super().__init__()
        self.config = cfg
        self.thinker = Thinker(cfg.thinker)
        self.talker = Talker(cfg.talker) if with_audio else None
        self.code2wav = Code2Wav(cfg.code2wav) if with_audio else None
        if with_audio:  # the Thinker's forward also returns the layer the Talker reads at media tokens
            self.thinker.keep_layer = cfg.talker.accept_hidden_layer


class OmniMapping(WeightMapping):
    """Drop derived buffers, skip the speech parts when not built, fuse each part's experts with its own count."""

    def __init__(self, cfg: OmniConfig, with_audio: bool):
        self.with_audio = with_audio
        self.fusions = {"thinker.": ExpertFusion(cfg.thinker.text.num_experts),
                        "talker.": ExpertFusion(cfg.talker.text.num_experts)}

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if _DERIVED.search(name) or (not self.with_audio and name.startswith(("talker.", "code2wav."))):
            return ()
        for prefix, fusion in self.fusions.items():
            if name.startswith(prefix):
                fused = fusion.take(name, tensor)
                if fused is not None:
                    return fused
        return ((name, tensor),)

    def flush(self) -> Iterable[tuple[str, torch.Tensor]]:
        missing = [m for f in self.fusions.values() for m in f.incomplete()]
        if missing:
            raise CheckpointError("checkpoint is missing expert weights: " + ", ".join(missing[:20]))
        return ()


def load_omni(
    directory: str | Path,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    with_audio: bool | None = None,
    progress: bool = True,
) -> QwenOmni:
    """Build on meta and load a Qwen3-Omni checkpoint directory; the speech parts only if audio output is on."""
    cfg = OmniConfig.from_hf(read_config(directory))
    audio = cfg.enable_audio_output if with_audio is None else with_audio
    return build_and_load(lambda: QwenOmni(cfg, audio), open_checkpoint(directory), OmniMapping(cfg, audio),
                          dtype=dtype, device=device, progress=progress)


def expert_layout(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused `experts.{gate_up_proj, down_proj}` -> per-expert `experts.E.{gate,up,down}_proj.weight` (published)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def save_omni(model: QwenOmni, directory: str | Path, config: Mapping, *, shards: int = 15,
              extra_files: Mapping | None = None) -> Path:
    """Write `model` in the published layout: `shards` safetensors files (about equal in size) plus the index."""
    state = expert_layout(model.state_dict())
    total = sum(t.numel() * t.element_size() for t in state.values())
    limit = total // shards + 1
    while len(_count_shards(state, limit)) > shards:  # greedy packing may need a little more room per shard
        limit = int(limit * 1.05) + 1
    return save_hf_checkpoint(state, directory, config, max_shard_bytes=limit, extra_files=extra_files)


def _count_shards(state: Mapping[str, torch.Tensor], limit: int) -> list[int]:
    sizes, size = [], 0
    for tensor in state.values():
        n = tensor.numel() * tensor.element_size()
        if size and size + n > limit:
            sizes.append(size)
            size = 0
        size += n
    return [*sizes, size]
