"""SNAC codec configuration, read from the checkpoint's `config.json` (the `snac.SNAC` constructor kwargs)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from mstar_core.errors import ConfigError

_KNOWN = {
    "sampling_rate", "encoder_dim", "encoder_rates", "latent_dim", "decoder_dim", "decoder_rates",
    "attn_window_size", "codebook_size", "codebook_dim", "vq_strides", "noise", "depthwise",
}


@attrs.frozen
class SNACConfig:
    """The fields of SNAC's config that decoding needs (encoder fields only fix the latent width and hop)."""

    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = None
    decoder_dim: int = 1024
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    attn_window_size: int | None = None
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: tuple[int, ...] = (4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SNACConfig:
        """Build from a config dict; unknown keys and unsupported options fail naming the key."""
        unknown = sorted(set(raw) - _KNOWN)
        if unknown:
            raise ConfigError(f"SNAC config.json has unknown key(s) {unknown}; known: {sorted(_KNOWN)}")
        kw = dict(raw)
        for key in ("encoder_rates", "decoder_rates", "vq_strides"):
            if key in kw:
                kw[key] = tuple(int(v) for v in kw[key])
        cfg = cls(**kw)
        if cfg.attn_window_size is not None:
            raise ConfigError(
                f"SNAC config.json: attn_window_size={cfg.attn_window_size} is not supported; "
                "the 24 kHz codec Orpheus uses has attn_window_size null"
            )
        if cfg.decoder_dim % (2 ** len(cfg.decoder_rates)):
            raise ConfigError(
                f"SNAC config.json: decoder_dim {cfg.decoder_dim} must be divisible by 2**len(decoder_rates)"
            )
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> SNACConfig:
        """Read a SNAC `config.json`."""
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"SNAC config not found at {path}; a SNAC checkpoint dir holds config.json") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The config as SNAC's constructor kwargs (JSON-ready)."""
        out = attrs.asdict(self)
        for key in ("encoder_rates", "decoder_rates", "vq_strides"):
            out[key] = list(out[key])
        return out

    @property
    def latent(self) -> int:
        """Width of the quantized latent the decoder consumes."""
        return self.latent_dim if self.latent_dim is not None else self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        """Audio samples per latent step."""
        return math.prod(self.encoder_rates)
