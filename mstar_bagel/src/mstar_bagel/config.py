"""`BagelConfig`: a BAGEL checkpoint's `config.json`, `llm_config.json` and `vit_config.json` read strictly.

`llm_config.json` is a Qwen2 config (BAGEL forces `qk_norm`, untied embeddings); `vit_config.json` is a
SigLIP vision config whose last layer the loader drops (BAGEL uses the penultimate layer's features).
`config.json` carries BAGEL's own settings (`latent_patch_size`, `max_latent_size`,
`vit_max_num_patch_per_side`, `connector_act`) and, for presets, `mstar_vae` (the FLUX autoencoder's
sizes; absent = FLUX.1's, which has no config file of its own) and the sampling defaults
`mstar_timestep_shift` / `mstar_num_timesteps` (absent: BAGEL's inference settings, 3.0 and 50).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from mstar_core.errors import ConfigError
from mstar_core.nn.flux_vae import FluxVAEConfig
from mstar_core.nn.llama_config import LlamaConfig
from mstar_core.nn.qwen2_mot import mot_config
from mstar_core.nn.siglip import SiglipVisionConfig

FILES = ("config.json", "llm_config.json", "vit_config.json")
_DEFAULTS = {"latent_patch_size": 2, "max_latent_size": 64, "vit_max_num_patch_per_side": 70,
             "connector_act": "gelu_pytorch_tanh", "timestep_shift": 3.0, "num_timesteps": 50}
INFERENCE_KEYS = {"timestep_shift": "mstar_timestep_shift", "num_timesteps": "mstar_num_timesteps"}


def _read(directory: Path, name: str) -> dict[str, Any]:
    path = directory / name
    if not path.is_file():
        raise ConfigError(f"bagel: {path} is missing; a BAGEL checkpoint has {', '.join(FILES)}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"bagel: {path} is not valid JSON ({exc})") from None


@attrs.frozen(kw_only=True)
class BagelConfig:
    llm: LlamaConfig
    vit: SiglipVisionConfig
    vae: FluxVAEConfig
    latent_patch_size: int = 2
    max_latent_size: int = 64
    vit_max_num_patch_per_side: int = 70
    connector_act: str = "gelu_pytorch_tanh"
    timestep_shift: float = 3.0
    num_timesteps: int = 50

    @property
    def hidden_size(self) -> int:
        return self.llm.hidden_size

    @property
    def latent_channels(self) -> int:
        return self.vae.z_channels

    @property
    def patch_latent_dim(self) -> int:
        return self.latent_patch_size**2 * self.vae.z_channels

    @property
    def latent_downsample(self) -> int:
        """Pixels per latent token along a side (VAE downsample x latent patch)."""
        return self.vae.downsample * self.latent_patch_size

    @classmethod
    def from_dicts(cls, top: Mapping[str, Any], llm: Mapping[str, Any], vit: Mapping[str, Any]) -> BagelConfig:
        # the sampling defaults are BAGEL's inference settings (shift 3, 50 timesteps), not config.json's training
        # `timestep_shift`; a preset may set its own under `mstar_timestep_shift` / `mstar_num_timesteps`
        values = {k: top.get(INFERENCE_KEYS.get(k, k), d) for k, d in _DEFAULTS.items()}
        for key in ("latent_patch_size", "max_latent_size", "vit_max_num_patch_per_side", "num_timesteps"):
            if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 1:
                raise ConfigError(f"bagel config.json: key '{key}' must be a positive integer, got {values[key]!r}")
        if values["num_timesteps"] < 2:
            raise ConfigError("bagel config.json: key 'num_timesteps' must be at least 2 (it counts the schedule's points)")
        vit_cfg = dict(vit)
        layers = vit_cfg.get("num_hidden_layers")
        if not isinstance(layers, int) or layers < 2:
            raise ConfigError(f"bagel vit_config.json: num_hidden_layers must be an int >= 2 (the last is dropped), got {layers!r}")
        vit_cfg["num_hidden_layers"] = layers - 1  # BAGEL reads the penultimate layer: the last is never built
        vision = SiglipVisionConfig.from_hf(vit_cfg)
        llm_cfg = mot_config(dict(llm))
        if llm_cfg.tie_word_embeddings:
            raise ConfigError("bagel llm_config.json: tie_word_embeddings must be false (BAGEL unties them)")
        out = cls(llm=llm_cfg, vit=vision, vae=FluxVAEConfig.from_dict(top.get("mstar_vae")), **values)
        if vision.image_size // vision.patch_size < out.vit_max_num_patch_per_side:
            raise ConfigError(f"bagel: the ViT's position table has {vision.image_size // vision.patch_size} patches per "
                              f"side, fewer than vit_max_num_patch_per_side ({out.vit_max_num_patch_per_side})")
        return out

    @classmethod
    def from_dir(cls, directory: str | Path, table_sides: Mapping[str, int] | None = None) -> BagelConfig:
        """`table_sides`: grid sides read off the checkpoint's position tables; they win over config.json, whose
        values upstream's loader overrides in code (BAGEL's inference sets max_latent_size 64 itself)."""
        d = Path(directory)
        top, llm, vit = (_read(d, name) for name in FILES)
        return cls.from_dicts({**top, **(table_sides or {})}, llm, vit)
