"""The codec decoder blocks Qwen3-Omni's Code2Wav and Qwen3-TTS's 12 Hz tokenizer decoder share (fp32, causal).

A causal sliding-window transformer with LayerScale (`PreTransformer`), ConvTranspose + ConvNeXt upsampling,
SnakeBeta residual stages (`DecoderBlock`) and the causal convolutions they are made of, and the streaming
window node (`WindowDecoder`: one `LeftContextChunkPolicy` window of frames -> its new samples). Parameter names
are the checkpoints' (`pre_transformer.layers.N.*`, `upsample.N.{0,1}.*`, `decoder.N.block.M.*`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.config.hf import config_field
from mstar_core.nn.attention import DenseAttention
from mstar_core.nn.mlp import GatedMLP
from mstar_core.nn.norm import RMSNorm
from mstar_core.nn.rotary import RotaryEmbedding
from mstar_core.nn.self_attention import GroupedQueryAttention
from mstar_core.streaming import Chunk


class SlidingTransformerConfig(Protocol):
    """The sizes `PreTransformer` reads (the model package's codec config)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    layer_scale_initial_scale: float
    rms_norm_eps: float
    intermediate_size: int
    hidden_act: str
    num_hidden_layers: int
    sliding_window: int
    rope_theta: float


class CausalConv1d(nn.Module):
    """Conv1d padded on the left only (stride 1 here, so the length is kept)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.pad = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.pad, 0)))


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d trimmed by `kernel - stride` samples at the end, and (Qwen3-Omni's) also at the start.

    Qwen3-TTS's tokenizer trims the end only (`trim_start=False`): with kernel 2r and stride r that keeps r
    samples per frame more at the start than Omni's Code2Wav does.
    """

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, trim_start: bool = True):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride
        self.start = self.trim if trim_start else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.start : y.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class SnakeBeta(nn.Module):
    """`x + sin^2(x * e^alpha) / (e^beta + 1e-9)` per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.exp()[None, :, None]
        beta = self.beta.exp()[None, :, None]
        if torch.is_grad_enabled():
            return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)
        # the same ops in the same order, in place on one buffer: a window's activations are megabytes, and four
        # fresh ones a call cost as much as the arithmetic (bitwise the expression above)
        out = x * alpha
        return out.sin_().square_().mul_(1.0 / (beta + 1e-9)).add_(x)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """Stage `i` of the waveform decoder: SnakeBeta, a `rate`x transposed conv halving the channels, 3 residual units."""

    def __init__(self, decoder_dim: int, upsample_rates: Sequence[int], i: int, trim_start: bool = True):
        super().__init__()
        cin, cout, rate = decoder_dim // 2**i, decoder_dim // 2 ** (i + 1), upsample_rates[i]
        self.block = nn.ModuleList([SnakeBeta(cin), CausalConvTranspose1d(cin, cout, 2 * rate, rate, trim_start),
                                    *(ResidualUnit(cout, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    """Pre-norm attention and SwiGLU, each residual branch scaled per channel (LayerScale)."""

    def __init__(self, cfg: SlidingTransformerConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                               cfg.head_dim, i, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x, rope, context) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, context))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """The codec's causal sliding-window transformer over one sequence of frames (`layers`, `norm`)."""

    def __init__(self, cfg: SlidingTransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, {"rope_type": "default", "rope_theta": cfg.rope_theta})
        self.window = cfg.sliding_window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, H]` -> `[T, H]`: causal, each frame sees itself and the `window - 1` before it."""
        t = x.shape[0]
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        context = DenseAttention(mask=mask)
        rope = self.rotary_emb(i)
        for layer in self.layers:
            x = layer(x, rope, context)
        return self.norm(x)


@attrs.frozen(kw_only=True)
class CodecDecoderConfig:
    """The codec decoder sizes Qwen3-Omni's `code2wav_config` and the Qwen3-TTS tokenizer's `decoder_config` share,
    with their common published defaults; each model's subclass adds its widths (they differ) and own keys."""

    codebook_size: int = 2048
    num_attention_heads: int = config_field(16, minimum=1)
    num_key_value_heads: int = config_field(16, minimum=1)
    attention_bias: bool = False
    sliding_window: int = 72
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    rope_theta: float = 10000.0

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples a frame of codes becomes: the product of every upsampling stage's factor."""
        total = 1
        for r in (*self.upsample_rates, *self.upsampling_ratios):
            total *= r
        return total


class CodecWaveDecoderConfig(SlidingTransformerConfig, Protocol):
    """What `CodecWaveDecoder` reads besides the transformer's sizes."""

    num_quantizers: int
    upsampling_ratios: Sequence[int]
    upsample_rates: Sequence[int]
    decoder_dim: int
    samples_per_frame: int


class CodecWaveDecoder(nn.Module):
    """`forward(codes [B, Q, T])` -> waveform `[B, 1, T * samples_per_frame]` in [-1, 1] (Qwen3-Omni's Code2Wav, the
    Qwen3-TTS tokenizer's decoder).

    The subclass's `frames` turns codes into per-frame rows `[B, T, width]`; `pre_transformer` (one of `front`,
    the subclass's modules, registered in order before the shared stages: their order is the checkpoint's and
    the seeded presets') refines each sequence; ConvTranspose + ConvNeXt stages upsample and the SnakeBeta
    vocoder makes the waveform. `trim_start`: see `CausalConvTranspose1d` (the one real difference of the two).
    Streaming decodes windows with left context and drops the context's samples (`decode_window`), which is
    what the upstream `chunked_decode` does offline.
    """

    pre_transformer: nn.Module
    offline_chunk = 25  # `chunked_decode`'s default window of new frames (the upstream one)

    def __init__(self, cfg: CodecWaveDecoderConfig, front: Mapping[str, nn.Module], width: int, trim_start: bool):
        super().__init__()
        if "pre_transformer" not in front:
            raise TypeError("CodecWaveDecoder needs a 'pre_transformer' among its front modules")
        self.config = cfg
        self.samples_per_frame = cfg.samples_per_frame
        for name, module in front.items():
            self.add_module(name, module)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(width, width, f, f, trim_start=trim_start), ConvNeXtBlock(width)])
            for f in cfg.upsampling_ratios
        )
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        self.decoder = nn.ModuleList([
            CausalConv1d(width, cfg.decoder_dim, 7),
            *(DecoderBlock(cfg.decoder_dim, cfg.upsample_rates, i, trim_start=trim_start)
              for i in range(len(cfg.upsample_rates))),
            SnakeBeta(out_dim),
            CausalConv1d(out_dim, 1, 7),
        ])

    def frames(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes `[B, Q, T]` -> the transformer's input rows `[B, T, width]` (the model's own embedding)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.decoder[-1].conv.weight.device

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if codes.dim() != 3 or codes.shape[1] != cfg.num_quantizers:
            raise ValueError(f"codes must be [batch, {cfg.num_quantizers}, frames], got {list(codes.shape)}")
        hidden = torch.stack([self.pre_transformer(h) for h in self.frames(codes)]).transpose(1, 2)
        for stage in self.upsample:
            for layer in stage:
                hidden = layer(hidden)
        for layer in self.decoder:
            hidden = layer(hidden)
        return hidden.clamp(-1, 1)

    def decode_window(self, codes: torch.Tensor, context: int) -> torch.Tensor:
        """Decode `[B, Q, context + new]` frames and keep only the new frames' samples `[B, 1, new * spf]`."""
        return self(codes)[..., context * self.samples_per_frame :]

    def chunked_decode(self, codes: torch.Tensor, chunk: int | None = None, left: int = 25) -> torch.Tensor:
        """Offline decode in windows of `chunk` (default `offline_chunk`) new frames with up to `left` frames of
        context (the streamed result)."""
        chunk = self.offline_chunk if chunk is None else chunk
        out, start, total = [], 0, codes.shape[-1]
        while start < total:
            end = min(start + chunk, total)
            context = min(left, start)
            out.append(self.decode_window(codes[..., start - context : end], context))
            start = end
        return torch.cat(out, dim=-1)


class WindowDecoder(nn.Module):
    """A window of frames (context first) -> the new frames' samples `[n]` (fp32), for a codec with
    `decode_window(codes [B, Q, frames], context) -> [B, 1, samples]` and a `device` property.

    `forward_batch` decodes the windows of several requests that have the same length and context as one batch:
    sessions that speak at once reach a window boundary together, and one call then pays the vocoder's many
    small convolutions once for all of them.
    """

    def __init__(self, codec: nn.Module):
        super().__init__()
        self.codec = codec

    def forward(self, codes: Chunk) -> torch.Tensor:
        return self.forward_batch([{"codes": codes}])[0]["audio"]

    def forward_batch(self, calls: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        shapes: dict[tuple[int, int], list[int]] = {}
        for i, call in enumerate(calls):
            shapes.setdefault((len(call["codes"].items), call["codes"].num_context), []).append(i)
        device = self.codec.device
        out: list[dict[str, torch.Tensor]] = [{} for _ in calls]
        for (_, context), at in shapes.items():
            frames = torch.stack([torch.stack(list(calls[i]["codes"].items), dim=1) for i in at])  # [B, Q, frames]
            with torch.inference_mode():
                wav = self.codec.decode_window(frames.to(device), context)
            for row, i in enumerate(at):
                out[i] = {"audio": wav[row, 0].float()}
        return out
