"""The Base checkpoints' speaker encoder: ECAPA-TDNN over a 128-bin log-mel of 24 kHz audio -> one x-vector whose
width is the Talker's, which fills the prompt's speaker slot (a cloned voice).

Log-mel: reflect-padded Hann STFT (n_fft 1024, hop 256, no centring), magnitude, Slaney mel filters (0-12 kHz),
natural log floored at 1e-5. Network: a TDNN, three SE-Res2Net blocks (dilations 2, 3, 4), multi-layer feature
aggregation, attentive statistics pooling, a 1x1 conv. Every conv pads "same" by reflection. Names are the
checkpoint's (`speaker_encoder.*`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.config.hf import read_fields
from mstar_core.nn.whisper_features import mel_filters


@attrs.frozen(kw_only=True)
class SpeakerEncoderConfig:
    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> SpeakerEncoderConfig:
        return read_fields(cls, cfg, "speaker_encoder_config")


def _conv(cin: int, cout: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    return nn.Conv1d(cin, cout, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, dilation: int):
        super().__init__()
        self.conv = _conv(cin, cout, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Channels split in `scale` groups; group i > 0 goes through its TDNN after adding group i - 1's output."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int):
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(TDNN(channels // scale, channels // scale, kernel, dilation)
                                    for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(x.chunk(self.scale, dim=1))
        out = [parts[0]]
        for i in range(1, self.scale):
            out.append(self.blocks[i - 1](parts[i] if i == 1 else parts[i] + out[-1]))
        return torch.cat(out, dim=1)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.conv1 = _conv(channels, squeeze)
        self.conv2 = _conv(squeeze, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))


class SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, squeeze: int, kernel: int, dilation: int):
        super().__init__()
        self.tdnn1 = TDNN(cin, cout, 1, 1)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = TDNN(cout, cout, 1, 1)
        self.se_block = SqueezeExcitation(cout, squeeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _stats(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = (weights * x).sum(2)
    std = (weights * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(min=1e-12).sqrt()
    return mean, std


class AttentiveStatsPooling(nn.Module):
    """Per-channel attention over time (conditioned on the global mean and std) -> weighted mean and std."""

    def __init__(self, channels: int, attention: int):
        super().__init__()
        self.tdnn = TDNN(channels * 3, attention, 1, 1)
        self.conv = _conv(attention, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        mean, std = _stats(x, torch.full_like(x[:, :1], 1.0 / t))
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], dim=1)
        weights = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)
        mean, std = _stats(x, weights)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """`forward(mels [B, T, mel_dim])` -> x-vectors `[B, enc_dim]`; `embed(waveform 24 kHz)` -> `[enc_dim]`."""

    def __init__(self, cfg: SpeakerEncoderConfig):
        super().__init__()
        self.config = cfg
        ch, k, d = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.blocks = nn.ModuleList([TDNN(cfg.mel_dim, ch[0], k[0], d[0]), *(
            SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, k[i], d[i])
            for i in range(1, len(ch) - 1))])
        self.mfa = TDNN(ch[-1], ch[-1], k[-1], d[-1])
        self.asp = AttentiveStatsPooling(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim)
        self.filters = mel_filters(1024, cfg.mel_dim, cfg.sample_rate, 0.0, cfg.sample_rate / 2)  # not a weight

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = mels.transpose(1, 2)
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))
        return self.fc(self.asp(x)).squeeze(-1)

    def log_mel(self, waveform: torch.Tensor) -> torch.Tensor:
        """24 kHz samples `[n]` -> `[frames, mel_dim]` (n_fft 1024, hop 256)."""
        n_fft, hop = 1024, 256
        pad = (n_fft - hop) // 2
        wav = F.pad(waveform.float().view(1, 1, -1), (pad, pad), mode="reflect").view(-1)
        spec = torch.stft(wav, n_fft, hop, window=torch.hann_window(n_fft, device=wav.device), center=False,
                          return_complex=True)
        magnitude = (torch.view_as_real(spec).pow(2).sum(-1) + 1e-9).sqrt()
        mel = self.filters.to(wav.device).t() @ magnitude
        return mel.clamp(min=1e-5).log().t()

    @torch.inference_mode()
    def embed(self, waveform: torch.Tensor) -> torch.Tensor:
        weight = self.fc.weight
        return self(self.log_mel(waveform.to(weight.device))[None].to(weight.dtype))[0]
