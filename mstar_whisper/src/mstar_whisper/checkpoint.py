"""Reading a Hugging Face Whisper directory: config.json, generation_config.json, preprocessor_config.json and the
(possibly sharded) safetensors weights, with every missing, unexpected or mis-shaped tensor named at once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mstar_core.checkpoint import open_checkpoint
from mstar_core.checkpoint.loader import build_and_load
from mstar_core.checkpoint.mapping import WeightMapping
from mstar_core.errors import ConfigError
from mstar_whisper.config import WhisperConfig, WhisperTokens
from mstar_whisper.features import WhisperFeatures
from mstar_whisper.modeling import WhisperForConditionalGeneration


class _TiedHead(WeightMapping):
    """`proj_out.weight` is the token embedding (tied); a checkpoint that stores it anyway loads the same."""

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name != "proj_out.weight":
            yield name, tensor


def _json(directory: Path, name: str, required: bool = True) -> dict[str, Any]:
    path = directory / name
    if not path.is_file():
        if required:
            raise ConfigError(f"whisper checkpoint {directory} has no {name}")
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None


def load_whisper(directory: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu",
                 progress: bool = True) -> tuple[WhisperForConditionalGeneration, WhisperConfig, WhisperTokens,
                                                 WhisperFeatures]:
    directory = Path(directory)
    config = WhisperConfig.from_mapping(_json(directory, "config.json"))
    tokens = WhisperTokens.from_generation_config(_json(directory, "generation_config.json"))
    features = WhisperFeatures.from_preprocessor_config(_json(directory, "preprocessor_config.json", required=False))
    if features.mel.filters.shape[1] != config.num_mel_bins:
        raise ConfigError(f"whisper: preprocessor_config.json feature_size {features.mel.filters.shape[1]} differs "
                          f"from config.json num_mel_bins {config.num_mel_bins}")
    model = build_and_load(lambda: WhisperForConditionalGeneration(config, tokens), open_checkpoint(directory),
                           _TiedHead(), dtype=dtype, device=device, progress=progress)
    return model, config, tokens, features
