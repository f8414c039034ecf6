"""Whisper's shape (`config.json`) and its special tokens (`generation_config.json`), read strictly."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.errors import ConfigError

#: The config keys the model is built from (others in a real config.json are ignored: dropout, init, ...).
REQUIRED = ("d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads", "decoder_attention_heads",
            "encoder_ffn_dim", "decoder_ffn_dim", "num_mel_bins", "vocab_size", "max_source_positions",
            "max_target_positions")


@attrs.frozen
class WhisperConfig:
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    num_mel_bins: int
    vocab_size: int
    max_source_positions: int
    max_target_positions: int
    activation_function: str = "gelu"
    median_filter_width: int = 7  # word timestamps: the alignment weights' median filter along time

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> WhisperConfig:
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise ConfigError(f"whisper config.json lacks {', '.join(missing)}")
        bad = [k for k in REQUIRED if type(raw[k]) is not int or raw[k] < 1]
        if bad:
            raise ConfigError(f"whisper config.json: {', '.join(bad)} must be positive integers")
        act = raw.get("activation_function", "gelu")
        if act != "gelu":
            raise ConfigError(f"whisper config.json: activation_function {act!r} is not served (only 'gelu')")
        for side in ("encoder", "decoder"):
            if raw["d_model"] % raw[f"{side}_attention_heads"]:
                raise ConfigError(f"whisper config.json: d_model must divide by {side}_attention_heads")
        width = raw.get("median_filter_width", 7)
        if type(width) is not int or width < 1 or width % 2 == 0:
            raise ConfigError(f"whisper config.json: median_filter_width must be a positive odd integer, got {width!r}")
        return cls(**{k: raw[k] for k in REQUIRED}, activation_function=act, median_filter_width=width)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads

    # what the kvcache engine sizes its pool from (the decoder's layers and heads)
    @property
    def num_hidden_layers(self) -> int:
        return self.decoder_layers

    @property
    def num_key_value_heads(self) -> int:
        return self.decoder_attention_heads

    @property
    def num_attention_heads(self) -> int:
        return self.decoder_attention_heads

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def max_position_embeddings(self) -> int:
        return self.max_target_positions


@attrs.frozen
class WhisperTokens:
    """The special ids decoding needs, from `generation_config.json` (multilingual, v3 and `.en` layouts alike)."""

    sot: int
    eot: int
    no_timestamps: int
    prev_sot: int
    languages: Mapping[str, int]  # "en" -> id
    tasks: Mapping[str, int]  # "transcribe" / "translate" -> id
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    max_initial_timestamp_index: int
    alignment_heads: tuple[tuple[int, int], ...] = ()
    max_length: int = 448

    @property
    def no_speech(self) -> int:
        return self.no_timestamps - 1

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def from_generation_config(cls, raw: Mapping[str, Any]) -> WhisperTokens:
        need = ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id")
        missing = [k for k in need if raw.get(k) is None]
        if missing:
            raise ConfigError(f"whisper generation_config.json lacks {', '.join(missing)}")
        eos = raw["eos_token_id"]
        languages = {k.strip("<|>"): int(v) for k, v in (raw.get("lang_to_id") or {}).items()}
        return cls(
            sot=int(raw["decoder_start_token_id"]),
            eot=int(eos[0] if isinstance(eos, list) else eos),
            no_timestamps=int(raw["no_timestamps_token_id"]),
            prev_sot=int(raw.get("prev_sot_token_id") or raw["no_timestamps_token_id"] - 2),
            languages=languages,
            tasks={k: int(v) for k, v in (raw.get("task_to_id") or {}).items()},
            suppress=tuple(int(t) for t in raw.get("suppress_tokens") or ()),
            begin_suppress=tuple(int(t) for t in raw.get("begin_suppress_tokens") or ()),
            max_initial_timestamp_index=int(raw.get("max_initial_timestamp_index") or 50),
            alignment_heads=tuple((int(a), int(b)) for a, b in raw.get("alignment_heads") or ()),
            max_length=int(raw.get("max_length") or 448),
        )

    def language_id(self, language: str | None) -> int | None:
        if language is None:
            return None
        code = language.strip().lower()
        return self.languages.get(code)
