"""`ModelSpec` `bagel`: a BAGEL checkpoint directory or the `tiny` preset -> `LoadedModel`."""

from __future__ import annotations

from mstar_core.errors import ConfigError
from mstar_core.model import LoadedModel, LoadOptions, ModelSpec

PRESETS = ("tiny",)


def load(options: LoadOptions) -> LoadedModel:
    raise ConfigError("bagel: the graph is not wired yet")


SPEC = ModelSpec(name="bagel", load=load, presets=PRESETS,
                 description="BAGEL: MoT LLM + SigLIP NaViT + FLUX VAE; understanding, text-to-image, image editing")
