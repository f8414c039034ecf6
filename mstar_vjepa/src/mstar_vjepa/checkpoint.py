"""Weights: HF `facebook/vjepa2-*` (safetensors, separate q/k/v) and upstream AC `.pt` (prefixed keys, fused qkv).

Presets are written in those same layouts from seeded random weights, then loaded back through these loaders.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from mstar_core.checkpoint import (
    CheckpointError,
    SafetensorsSource,
    WeightMapping,
    build_and_load,
    save_hf_checkpoint,
)
from mstar_core.checkpoint.presets import preset_root
from mstar_core.errors import ConfigError
from mstar_vjepa.ac_predictor import ACPredictor
from mstar_vjepa.config import VIT_SIZES, ACPredictorConfig, VJEPA2Config
from mstar_vjepa.encoder import VJEPA2Encoder
from mstar_vjepa.predictor import VJEPA2Model

AC_FILE = "vjepa2-ac.pt"
_QKV = ("query", "key", "value")


def load_hf(directory: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> VJEPA2Model:
    """A HF VJEPA2 checkpoint directory (`config.json` + `model.safetensors`) -> encoder + masked predictor."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json; expected a Hugging Face facebook/vjepa2-* directory")
    cfg = VJEPA2Config.from_file(directory / "config.json")
    return build_and_load(lambda: VJEPA2Model(cfg), SafetensorsSource(directory), dtype=dtype, device=device,
                          progress=False)


class _DictSource:
    """A TensorSource over an in-memory state dict (one part of the upstream `.pt`)."""

    def __init__(self, state: dict[str, torch.Tensor], where: str):
        self.state, self.where = state, where

    def __len__(self) -> int:
        return len(self.state)

    def items(self):
        return iter(self.state.items())


def _strip(name: str) -> str:
    for prefix in ("module.", "backbone."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


class UpstreamEncoderMapping(WeightMapping):
    """Upstream ViT names (`blocks.i.attn.qkv`, `patch_embed`, `norm`) -> HF names; fused qkv split in three."""

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = _strip(_strip(name))
        m = re.fullmatch(r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", name)
        if m:
            return [(f"layer.{m[1]}.attention.{p}.{m[2]}", t) for p, t in zip(_QKV, tensor.chunk(3), strict=True)]
        name = re.sub(r"^blocks\.(\d+)\.attn\.", r"layer.\1.attention.", name)
        name = re.sub(r"^blocks\.", "layer.", name)
        name = name.replace("patch_embed.proj.", "embeddings.patch_embeddings.proj.")
        return [(re.sub(r"^norm\.", "layernorm.", name), tensor)]


class UpstreamPredictorMapping(WeightMapping):
    """Strip `module.`/`backbone.`; drop the extrinsics encoder upstream builds but this config never uses."""

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = _strip(_strip(name))
        return [] if name.startswith("extrinsics_encoder.") else [(name, tensor)]


def ac_configs(directory: Path) -> tuple[VJEPA2Config, ACPredictorConfig]:
    """Sizes from a sidecar `config.json` ({encoder, predictor}); without one, upstream's ViT-g AC release."""
    path = directory / "config.json"
    if path.is_file():
        data = json.loads(path.read_text())
        missing = [part for part in ("encoder", "predictor") if not isinstance(data, dict) or part not in data]
        if missing:
            raise ConfigError(f"{path}: the AC sidecar config needs sections 'encoder' and 'predictor'; missing {missing}")
        return (VJEPA2Config.from_dict(data["encoder"], "encoder"),
                ACPredictorConfig.from_dict(data["predictor"], "predictor"))
    return VJEPA2Config(**VIT_SIZES["vitg"], crop_size=256), ACPredictorConfig()


def load_ac(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
            predictor_device: str | None = None):
    """Upstream AC checkpoint (a `.pt` file or a directory holding one) -> (encoder, AC predictor).

    `predictor_device` (default `device`) lets a process build one part on the meta device (hosted elsewhere);
    the file is memory-mapped, so a part built there is never read.
    """
    path = Path(path)
    file = path / AC_FILE if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"no AC checkpoint at {file}; expected upstream's {{encoder, predictor}} .pt file")
    enc_cfg, pred_cfg = ac_configs(file.parent)
    blob = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    for part in ("encoder", "predictor"):
        if part not in blob:
            raise CheckpointError(f"{file} has no '{part}' state dict (keys: {sorted(blob)})")
    encoder = build_and_load(lambda: VJEPA2Encoder(enc_cfg), _DictSource(blob["encoder"], f"{file}[encoder]"),
                             UpstreamEncoderMapping(), dtype=dtype, device=device, progress=False)
    predictor = build_and_load(lambda: ACPredictor(pred_cfg), _DictSource(blob["predictor"], f"{file}[predictor]"),
                               UpstreamPredictorMapping(), dtype=dtype, device=predictor_device or device,
                               progress=False)
    return encoder, predictor


def to_upstream_encoder(encoder: VJEPA2Encoder) -> dict[str, torch.Tensor]:
    """Our encoder's weights under upstream names (fused qkv, `module.backbone.` prefix)."""
    out, held = {}, {}
    for name, t in encoder.state_dict().items():
        m = re.fullmatch(r"layer\.(\d+)\.attention\.(query|key|value)\.(weight|bias)", name)
        if m:
            held.setdefault((m[1], m[3]), {})[m[2]] = t
            continue
        name = re.sub(r"^layer\.(\d+)\.attention\.", r"blocks.\1.attn.", name)
        name = re.sub(r"^layer\.", "blocks.", name).replace("embeddings.patch_embeddings.proj.", "patch_embed.proj.")
        out["module.backbone." + re.sub(r"^layernorm\.", "norm.", name)] = t
    for (i, kind), parts in held.items():
        out[f"module.backbone.blocks.{i}.attn.qkv.{kind}"] = torch.cat([parts[p] for p in _QKV])
    return out


def preset_dir(name: str) -> Path:
    """Where preset `name` is written (see `mstar_core.checkpoint.presets.preset_root`)."""
    return preset_root() / name


TINY_HF = VJEPA2Config(crop_size=16, patch_size=16, frames_per_clip=2, tubelet_size=2, hidden_size=32,
                       num_attention_heads=2, num_hidden_layers=2, mlp_ratio=1.0, pred_hidden_size=32,
                       pred_num_attention_heads=2, pred_num_hidden_layers=2)
TINY_AC_ENCODER = VJEPA2Config(crop_size=32, patch_size=16, frames_per_clip=16, tubelet_size=2, hidden_size=32,
                               num_attention_heads=2, num_hidden_layers=2, mlp_ratio=2.0)
TINY_AC = ACPredictorConfig(img_size=32, patch_size=16, num_frames=16, tubelet_size=2, embed_dim=32,
                            predictor_embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Deterministic random weights; LayerNorm scales stay near 1 so activations keep a sane range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if p.dim() == 1 and name.endswith("weight") else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * 0.05)
    return module


def write_hf_preset(directory: Path, cfg: VJEPA2Config = TINY_HF, seed: int = 0) -> Path:
    """Seeded random VJEPA2 weights written as a HF checkpoint directory."""
    save_hf_checkpoint(_seeded(VJEPA2Model(cfg), seed), directory, cfg.to_dict())
    return directory


def write_ac_preset(directory: Path, enc_cfg: VJEPA2Config = TINY_AC_ENCODER, pred_cfg: ACPredictorConfig = TINY_AC,
                    seed: int = 0) -> Path:
    """Seeded random AC weights written as upstream's `.pt` ({encoder, predictor}) plus a sizes sidecar."""
    directory.mkdir(parents=True, exist_ok=True)
    predictor = _seeded(ACPredictor(pred_cfg), seed + 1)
    pred_state = {f"module.backbone.{k}": v for k, v in predictor.state_dict().items()}
    blob = {"encoder": to_upstream_encoder(_seeded(VJEPA2Encoder(enc_cfg), seed)), "predictor": pred_state}
    torch.save(blob, directory / AC_FILE)
    cfg = {"encoder": enc_cfg.to_dict(), "predictor": pred_cfg.to_dict()}
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory
