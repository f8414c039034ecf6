"""SNAC codec configuration, read from the checkpoint's `config.json` (the `snac.SNAC` constructor kwargs)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from mstar_core.config.hf import config_field, read_fields
from mstar_core.errors import ConfigError


@attrs.frozen
class SNACConfig:
    """The fields of SNAC's config that decoding needs (encoder fields only fix the latent width and hop)."""

    sampling_rate: int = config_field(24000, minimum=1)
    encoder_dim: int = config_field(48, minimum=1)
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int | None = config_field(None, minimum=1)
    decoder_dim: int = config_field(1024, minimum=1)
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    attn_window_size: int | None = None
    codebook_size: int = config_field(4096, minimum=1)
    codebook_dim: int = config_field(8, minimum=1)
    vq_strides: tuple[int, ...] = (4, 2, 1)
    noise: bool = True
    depthwise: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, file: str = "SNAC config.json") -> SNACConfig:
        """Build from a config dict; an unknown, wrong-typed or unsupported key fails naming `file` and the key."""
        cfg = read_fields(cls, raw, file=file, strict=True)  # the constructor kwargs: any other key is a typo
        if cfg.attn_window_size is not None:
            raise ConfigError(
                f"{file}: key 'attn_window_size' ({cfg.attn_window_size}) is not supported; "
                "the 24 kHz codec Orpheus uses has attn_window_size null"
            )
        if cfg.decoder_dim % (2 ** len(cfg.decoder_rates)):
            raise ConfigError(
                f"{file}: key 'decoder_dim' ({cfg.decoder_dim}) must be divisible by 2**len(decoder_rates)"
            )
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> SNACConfig:
        """Read a SNAC `config.json`."""
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"SNAC config not found at {path}; a SNAC checkpoint dir holds config.json") from None
        return cls.from_dict(raw, file=str(path))

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
