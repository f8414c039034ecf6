"""The 12 Hz speech tokenizer's encoder: reference audio (24 kHz) -> codes `[frames, 16]`, for the in-context clone
prompt. It is Mimi's encoder (`mstar_core.nn.mimi_encoder`) keeping the first `encoder_valid_num_quantizers` codes
and `ceil(samples / encode_downsample_rate)` frames, as the upstream tokenizer's `encode` does. Names are the
checkpoint's (`speech_tokenizer/model.safetensors`, `encoder.*`); it runs in fp32, as the decoder does.

`encodes` counts the calls: a cloned voice's codes are computed once, when the voice is created, and the speech
route's requests with that voice run no encoder (what the tests check).
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn.mimi_encoder import MimiEncoder
from mstar_qwen_tts.config import SpeechEncoderConfig


class SpeechEncoder(nn.Module):
    def __init__(self, cfg: SpeechEncoderConfig):
        super().__init__()
        self.config = cfg
        self.encoder = MimiEncoder(cfg)
        self.encodes = 0

    @property
    def sample_rate(self) -> int:
        return self.config.sampling_rate

    @torch.no_grad()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """`wav` `[N]` samples in [-1, 1] at `sample_rate` -> codes `[ceil(N / samples_per_frame), valid]`."""
        if wav.dim() != 1 or wav.numel() == 0:
            raise ValueError(f"wav must be one non-empty channel [samples], got {list(wav.shape)}")
        self.encodes += 1
        device = next(self.parameters()).device
        codes = self.encoder.encode(wav.to(device, torch.float32).view(1, 1, -1), self.config.valid_quantizers)[0]
        frames = -(-wav.numel() // self.config.samples_per_frame)
        return codes[:, :frames].transpose(0, 1).cpu()
