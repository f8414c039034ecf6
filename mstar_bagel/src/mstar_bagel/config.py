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

from mstar_core.config.hf import check, config_field, read_fields, section
from mstar_core.errors import ConfigError
from mstar_core.nn.flux_vae import FluxVAEConfig
from mstar_core.nn.llama_config import LlamaConfig
from mstar_core.nn.qwen2_mot import mot_config
from mstar_core.nn.siglip import SiglipVisionConfig

FILES = ("config.json", "llm_config.json", "vit_config.json")


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
    latent_patch_size: int = config_field(2, minimum=1)
    max_latent_size: int = config_field(64, minimum=1)
    vit_max_num_patch_per_side: int = config_field(70, minimum=1)
    connector_act: str = "gelu_pytorch_tanh"
    # BAGEL's inference settings (shift 3, 50 timesteps), not config.json's training `timestep_shift`;
    # a preset may set its own under the `mstar_` names
    timestep_shift: float = config_field(3.0, key="mstar_timestep_shift")
    num_timesteps: int = config_field(50, minimum=2, why="it counts the schedule's points", key="mstar_num_timesteps")
    #: the side of an image drawn without a size (0: the largest the grid draws, up to 1024, as BAGEL's inference)
    default_image_size: int = config_field(0, minimum=0, key="mstar_default_image_size")

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
        vit_cfg = dict(section(vit, "", file="vit_config.json"))
        layers = check(vit_cfg.get("num_hidden_layers"), int, "num_hidden_layers", file="vit_config.json",
                       minimum=2, why="the last is dropped")
        vit_cfg["num_hidden_layers"] = layers - 1  # BAGEL reads the penultimate layer: the last is never built
        vision = SiglipVisionConfig.from_hf(vit_cfg, file="vit_config.json")
        llm_cfg = mot_config(dict(section(llm, "", file="llm_config.json")))
        if llm_cfg.tie_word_embeddings:
            raise ConfigError("bagel llm_config.json: tie_word_embeddings must be false (BAGEL unties them)")
        vae = FluxVAEConfig.from_dict(section(top, "").get("mstar_vae"), "mstar_vae")
        out = read_fields(cls, top, llm=llm_cfg, vit=vision, vae=vae)
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
