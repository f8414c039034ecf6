"""Qwen3-TTS checkpoints: the published directory (`config.json`, `model.safetensors` with `talker.*` and, for
Base, `speaker_encoder.*`, `generation_config.json`, the Qwen2 tokenizer files, `speech_tokenizer/`) read into
`QwenTTS` and `SpeechDecoder`, and written back in that layout (the tiny preset).

Cloning reads the Base speaker encoder (built and loaded for `tts_model_type` "base": the x-vector) and the speech
tokenizer's `encoder.*` (Mimi: the reference audio's codes for the in-context clone prompt, `load_speech_encoder`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar_core.checkpoint import RuleMapping, build_and_load, open_checkpoint, read_config
from mstar_core.errors import ConfigError
from mstar_qwen_tts.config import SpeechDecoderConfig, SpeechEncoderConfig, TTSConfig
from mstar_qwen_tts.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig
from mstar_qwen_tts.speech_decoder import SpeechDecoder
from mstar_qwen_tts.speech_encoder import SpeechEncoder
from mstar_qwen_tts.talker import Talker

SPEECH_TOKENIZER = "speech_tokenizer"
_DERIVED = r"(\.rotary_emb\.inv_freq)$"


class QwenTTS(nn.Module):
    """The Talker under its checkpoint prefix (`talker.*`) and, for Base (cloning), the speaker encoder."""

    def __init__(self, cfg: TTSConfig):
        super().__init__()
        self.config = cfg
        self.talker = Talker(cfg.talker)
        self.speaker_encoder = None
        if cfg.tts_model_type == "base":
            enc = SpeakerEncoderConfig.from_hf(cfg.speaker_encoder)
            if enc.enc_dim != cfg.talker.text.hidden_size:
                raise ConfigError(f"config.json: 'speaker_encoder_config.enc_dim' ({enc.enc_dim}) must equal the "
                                  f"Talker's hidden_size ({cfg.talker.text.hidden_size}): the x-vector fills a "
                                  f"codec slot")
            self.speaker_encoder = SpeakerEncoder(enc)


def read_generation_config(directory: Path) -> dict[str, Any]:
    """`generation_config.json` as plain JSON (absent: the published defaults apply)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: must hold an object")
    return dict(data)


def load_tts(directory: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None,
             progress: bool = True) -> QwenTTS:
    directory = Path(directory)
    cfg = TTSConfig.from_hf(read_config(directory))
    # a non-Base checkpoint may still carry speaker-encoder weights: unused there
    skip = (_DERIVED,) if cfg.tts_model_type == "base" else (r"^speaker_encoder\.", _DERIVED)
    mapping = RuleMapping(skip=skip)
    return build_and_load(lambda: QwenTTS(cfg), open_checkpoint(directory), mapping, dtype=dtype, device=device,
                          progress=progress)


def load_speech_decoder(directory: str | Path, *, device: str = "cpu", progress: bool = True) -> SpeechDecoder:
    """`<checkpoint>/speech_tokenizer/`: its decoder, in fp32 (the codec always runs in fp32)."""
    where = Path(directory) / SPEECH_TOKENIZER
    if not (where / "config.json").is_file():
        raise ConfigError(f"{where}: no speech tokenizer (config.json + model.safetensors) beside the checkpoint")
    cfg = SpeechDecoderConfig.from_hf(json.loads((where / "config.json").read_text()))
    mapping = RuleMapping(skip=(r"^encoder\.", _DERIVED), rename=((r"^decoder\.", ""),))
    return build_and_load(lambda: SpeechDecoder(cfg), open_checkpoint(where), mapping, dtype=torch.float32,
                          device=device, progress=progress)


def load_speech_encoder(directory: str | Path, *, device: str = "cpu", progress: bool = True) -> SpeechEncoder:
    """`<checkpoint>/speech_tokenizer/`: its encoder (Mimi's, first half), in fp32. The quantizers' `output_proj`
    and `initialized` tensors (the decoding side, and a training flag) are not needed to encode."""
    where = Path(directory) / SPEECH_TOKENIZER
    if not (where / "config.json").is_file():
        raise ConfigError(f"{where}: no speech tokenizer (config.json + model.safetensors) beside the checkpoint")
    cfg = SpeechEncoderConfig.from_hf(json.loads((where / "config.json").read_text()))
    mapping = RuleMapping(skip=(r"^decoder\.", r"\.output_proj\.", r"\.codebook\.initialized$", _DERIVED))
    return build_and_load(lambda: SpeechEncoder(cfg), open_checkpoint(where), mapping, dtype=torch.float32,
                          device=device, progress=progress)
