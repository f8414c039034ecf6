"""Configs: the V-JEPA 2 encoder + masked predictor (HF `config.json`) and the AC predictor (upstream kwargs)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from mstar_core.config.hf import config_field, read_fields, section
from mstar_core.errors import ConfigError


@attrs.frozen(kw_only=True)
class VJEPA2Config:
    """Encoder (ViT with tubelet stem and 3-D RoPE) and masked predictor sizes, HF field names."""

    patch_size: int = config_field(16, minimum=1)
    crop_size: int = config_field(256, minimum=1)
    frames_per_clip: int = config_field(64, minimum=1)
    tubelet_size: int = config_field(2, minimum=1)
    hidden_size: int = config_field(1024, minimum=1)
    in_chans: int = config_field(3, minimum=1)
    num_attention_heads: int = config_field(16, minimum=1)
    num_hidden_layers: int = config_field(24, minimum=1)
    mlp_ratio: float = 4.0
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True
    hidden_act: str = "gelu"
    pred_hidden_size: int = config_field(384, minimum=1)
    pred_num_attention_heads: int = config_field(12, minimum=1)
    pred_num_hidden_layers: int = config_field(12, minimum=1)
    pred_num_mask_tokens: int = 10
    pred_mlp_ratio: float = 4.0

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads")
        if self.pred_hidden_size % self.pred_num_attention_heads:
            raise ConfigError(f"pred_hidden_size {self.pred_hidden_size} is not a multiple of pred_num_attention_heads")
        if self.hidden_act != "gelu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; V-JEPA 2 uses 'gelu'")

    @property
    def grid_size(self) -> int:
        return self.crop_size // self.patch_size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> VJEPA2Config:
        """Build from a HF `config.json` mapping; generic HF keys (architectures, dtype, ...) are ignored."""
        data = section(data, where)
        if data.get("model_type", "vjepa2") != "vjepa2":
            raise ConfigError(f"config.json has model_type {data.get('model_type')!r}, expected 'vjepa2'")
        return read_fields(cls, data, where)

    @classmethod
    def from_file(cls, path: str | Path) -> VJEPA2Config:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": "vjepa2", "architectures": ["VJEPA2Model"], **attrs.asdict(self)}


@attrs.frozen(kw_only=True)
class ACPredictorConfig:
    """Upstream `vit_ac_predictor` kwargs: img 256, 64 frames / tubelet 2 -> a 32-step frame-causal mask."""

    img_size: int = config_field(256, minimum=1)
    patch_size: int = config_field(16, minimum=1)
    num_frames: int = config_field(64, minimum=1)
    tubelet_size: int = config_field(2, minimum=1)
    embed_dim: int = config_field(1408, minimum=1)
    predictor_embed_dim: int = config_field(1024, minimum=1)
    depth: int = config_field(24, minimum=1)
    num_heads: int = config_field(16, minimum=1)
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    action_embed_dim: int = config_field(7, minimum=1)
    layer_norm_eps: float = 1e-6

    def __attrs_post_init__(self) -> None:
        if self.predictor_embed_dim % self.num_heads:
            raise ConfigError("predictor_embed_dim must be a multiple of num_heads")

    @property
    def grid_size(self) -> int:
        return self.img_size // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_size * self.grid_size

    @property
    def max_frames(self) -> int:
        """Steps the frame-causal mask is sized for (32 upstream); history may not exceed it."""
        return self.num_frames // self.tubelet_size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> ACPredictorConfig:
        """Upstream's kwargs, which M* writes itself (the sidecar `config.json`): unknown keys are typos, refused."""
        return read_fields(cls, data, where, strict=True)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


# Published encoder sizes (MODELS.md section 4); heads/mlp_ratio as in the HF configs.
VIT_SIZES: dict[str, dict[str, Any]] = {
    "vitl": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "mlp_ratio": 4.0},
    "vith": {"hidden_size": 1280, "num_hidden_layers": 32, "num_attention_heads": 16, "mlp_ratio": 4.0},
    "vitg": {"hidden_size": 1408, "num_hidden_layers": 40, "num_attention_heads": 22, "mlp_ratio": 48 / 11},
}
