"""The Thinker's audio encoder: Whisper-style log-mel frames -> 8x downsampled tokens in the Thinker's width.

Frames are cut into chunks of `2 * n_window` (100) frames; each chunk goes through three stride-2 3x3
convolutions (GELU), a linear over (channels x mel), and sinusoidal positions restarting per chunk; the
valid tokens of all chunks are concatenated and attended in windows of `n_window_infer` frames' worth of
tokens (bidirectional within a window), then layer norm, proj1, GELU, proj2. Names are the checkpoint's
(`thinker.audio_tower.*`). One audio -> `[tokens, output_dim]`, `tokens = audio_token_count(frames)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn.mlp import activation
from mstar_qwen_omni.config import AudioConfig


def _conv_len(n: int) -> int:
    return (n - 1) // 2 + 1


def audio_token_count(frames: int, n_window: int = 50) -> int:
    """Tokens the encoder makes from `frames` mel frames (13 per full chunk of 100 frames)."""
    chunk = 2 * n_window
    full, rest = divmod(frames, chunk)
    tail = _conv_len(_conv_len(_conv_len(rest))) if rest else 0
    return full * _conv_len(_conv_len(_conv_len(chunk))) + tail


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's fixed positions `[length, channels]`: sin of the first half of timescales, then cos."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2, device="cpu").float())
    t = torch.arange(length, device="cpu")[:, None].float() * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (p(x).view(t, self.heads, self.head_dim).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = [F.scaled_dot_product_attention(qw, kw, vw) for qw, kw, vw in
               zip(q.split(windows, 1), k.split(windows, 1), v.split(windows, 1), strict=True)]
        return self.out_proj(torch.cat(out, dim=1).transpose(0, 1).reshape(t, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.act = activation(cfg.activation_function)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """`forward(features [mel, frames])` -> audio tokens `[audio_token_count(frames), output_dim]`."""

    def __init__(self, cfg: AudioConfig):
        super().__init__()
        self.config = cfg
        c = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        freq = _conv_len(_conv_len(_conv_len(cfg.num_mel_bins)))
        self.conv_out = nn.Linear(c * freq, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.act = activation(cfg.activation_function)
        self.positions = sinusoids(cfg.max_source_positions, cfg.d_model)  # derived, not a weight

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if features.dim() != 2 or features.shape[0] != cfg.num_mel_bins:
            raise ValueError(f"audio features must be [{cfg.num_mel_bins}, frames], got {list(features.shape)}")
        frames = features.shape[1]
        chunk = 2 * cfg.n_window
        lengths = [chunk] * (frames // chunk) + ([frames % chunk] if frames % chunk else [])
        pieces = features.t().split(lengths)
        padded = nn.utils.rnn.pad_sequence(list(pieces), batch_first=True).transpose(1, 2)  # [C, mel, longest]
        x = padded.unsqueeze(1).to(self.conv2d1.weight.dtype)
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
        b, c, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(b, t, c * f))
        x = x + self.positions[:t].to(x.device, x.dtype)
        valid = [audio_token_count(n, cfg.n_window) for n in lengths]
        x = torch.cat([x[i, :n] for i, n in enumerate(valid)])
        # attention windows: `n_window_infer` frames' worth of tokens, sized from the longest chunk
        window = max(valid) * (cfg.n_window_infer // chunk)
        total = x.shape[0]
        windows = [window] * (total // window) + ([total % window] if total % window else [])
        for layer in self.layers:
            x = layer(x, windows)
        return self.proj2(self.act(self.proj1(self.ln_post(x))))
