"""The Wan2.2 video VAE (`AutoencoderKLWan` with `is_residual`; weight names as in diffusers' `vae/`).

RGB is patchified 2x2 into 12 channels, then compressed 4x in time and 8x in space more (48 latent channels,
4x16x16 overall). Every temporal convolution is causal: a conv pads on the left only, and when a video is
processed chunk by chunk each conv prepends the last two input frames it saw in the previous chunk. Those
frames are the decode's only state, held in a `FrameCache` that the caller carries from chunk to chunk (the
graph carries it through its decode `Loop`), so chunked decoding is exactly whole decoding.

Chunks follow the reference: encode takes frame 0, then 4 frames at a time; decode takes one latent frame at
a time, the first flagged (its temporal upsampling keeps one frame, so F latents give 1 + 4(F - 1) frames).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_wan.config import VAEConfig

CACHE_FRAMES = 2


class FrameCache:
    """The frames each causal conv keeps between chunks, in call order (a new chunk restarts the cursor)."""

    def __init__(self, slots: list[torch.Tensor | None] | None = None):
        self.slots: list[torch.Tensor | None] = list(slots or [])
        self.cursor = 0

    def take(self) -> torch.Tensor | None:
        return self.slots[self.cursor] if self.cursor < len(self.slots) else None

    def put(self, value: torch.Tensor) -> None:
        if self.cursor < len(self.slots):
            self.slots[self.cursor] = value
        else:
            self.slots.append(value)
        self.cursor += 1


class CausalConv3d(nn.Conv3d):
    """A Conv3d padded causally in time (2p frames on the left, none on the right), symmetrically in space."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__(cin, cout, kernel, stride=stride, padding=0)
        p = padding if isinstance(padding, tuple) else (padding,) * 3
        self.causal_pad = (p[2], p[2], p[1], p[1], 2 * p[0], 0)

    def forward(self, x: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        pad = list(self.causal_pad)
        if previous is not None and pad[4] > 0:
            x = torch.cat([previous.to(x.device), x], dim=2)
            pad[4] -= previous.shape[2]
        return super().forward(F.pad(x, pad))

    def cached(self, x: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
        """Run on a chunk, reading and updating this conv's slot: the last two input frames, across chunks."""
        if cache is None:
            return self(x)
        previous = cache.take()
        keep = x[:, :, -CACHE_FRAMES:].clone()
        if keep.shape[2] < CACHE_FRAMES and previous is not None:
            keep = torch.cat([previous[:, :, -1:].to(keep.device), keep], dim=2)
        out = self(x, previous)
        cache.put(keep)
        return out


class RMSNormChannels(nn.Module):
    """L2-normalise over channels (dim 1), times sqrt(C) and a per-channel gain."""

    def __init__(self, dim: int, spatial_dims: int):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *([1] * spatial_dims)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = RMSNormChannels(cin, 3)
        self.conv1 = CausalConv3d(cin, cout, 3, padding=1)
        self.norm2 = RMSNormChannels(cout, 3)
        self.conv2 = CausalConv3d(cout, cout, 3, padding=1)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
        h = self.conv_shortcut(x)
        x = self.conv1.cached(F.silu(self.norm1(x)), cache)
        x = self.conv2.cached(F.silu(self.norm2(x)), cache)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over each frame's pixels."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNormChannels(dim, 2)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = self.to_qkv(self.norm(x.transpose(1, 2).reshape(b * t, c, h, w)))
        q, k, v = y.reshape(b * t, 1, c * 3, h * w).transpose(2, 3).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v).squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        return self.proj(y).view(b, t, c, h, w).transpose(1, 2) + x


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def forward(self, x: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        return self.resnets[1](self.attentions[0](x), cache)


class _Upsample(nn.Upsample):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type_as(x)


class Resample(nn.Module):
    """2x spatial up/down-sampling per frame, with a causal 2x temporal one for the `3d` modes."""

    def __init__(self, dim: int, mode: str, out_dim: int | None = None):
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            self.resample = nn.Sequential(_Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                          nn.Conv2d(dim, out_dim or dim // 2, 3, padding=1))
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
            if mode == "downsample3d":
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if self.mode == "upsample3d" and cache is not None:
            previous = cache.take()
            if previous is None:  # the first chunk keeps its frame count: only later frames double
                cache.put(x.new_zeros(b, c, CACHE_FRAMES, h, w))
            else:
                pairs = self.time_conv.cached(x, cache).reshape(b, 2, c, t, h, w)
                x = torch.stack((pairs[:, 0], pairs[:, 1]), 3).reshape(b, c, t * 2, h, w)
        t = x.shape[2]
        x = self.resample(x.transpose(1, 2).reshape(b * t, c, h, w))
        x = x.view(b, t, *x.shape[1:]).transpose(1, 2)
        if self.mode == "downsample3d" and cache is not None:
            previous = cache.take()
            if previous is None:
                cache.put(x.clone())
            else:
                keep = x[:, :, -1:].clone()
                x = self.time_conv(torch.cat([previous[:, :, -1:], x], 2))
                cache.cursor += 1
                cache.slots[cache.cursor - 1] = keep
        return x


def _avg_down(x: torch.Tensor, cout: int, ft: int, fs: int) -> torch.Tensor:
    """The down blocks' shortcut: space/time folded into channels, then channel groups averaged."""
    x = F.pad(x, (0, 0, 0, 0, (ft - x.shape[2] % ft) % ft, 0))
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(b, cout, c * ft * fs * fs // cout, t // ft, h // fs, w // fs)
    return x.mean(dim=2)


def _dup_up(x: torch.Tensor, cout: int, ft: int, fs: int, first_chunk: bool) -> torch.Tensor:
    """The up blocks' shortcut: channels repeated, then unfolded into space/time."""
    b, c, t, h, w = x.shape
    x = x.repeat_interleave(cout * ft * fs * fs // c, dim=1).view(b, cout, ft, fs, fs, t, h, w)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, cout, t * ft, h * fs, w * fs)
    return x[:, :, ft - 1:] if first_chunk else x


class DownBlock(nn.Module):
    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, down: bool):
        super().__init__()
        self.cout, self.ft, self.fs = cout, 2 if temporal else 1, 2 if down else 1
        self.resnets = nn.ModuleList(ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks))
        self.downsampler = Resample(cout, "downsample3d" if temporal else "downsample2d") if down else None

    def forward(self, x: torch.Tensor, cache: FrameCache | None) -> torch.Tensor:
        shortcut = _avg_down(x, self.cout, self.ft, self.fs)
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return x + shortcut


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.cout, self.ft, self.up = cout, 2 if temporal else 1, up
        self.resnets = nn.ModuleList(ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1))
        self.upsampler = Resample(cout, "upsample3d" if temporal else "upsample2d", out_dim=cout) if up else None

    def forward(self, x: torch.Tensor, cache: FrameCache | None, first_chunk: bool) -> torch.Tensor:
        shortcut = _dup_up(x, self.cout, self.ft, 2, first_chunk) if self.up else None
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsampler is not None:
            x = self.upsampler(x, cache)
        return x if shortcut is None else x + shortcut


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
        last = len(cfg.dim_mult) - 1
        self.conv_in = CausalConv3d(cfg.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            DownBlock(dims[i], dims[i + 1], cfg.num_res_blocks, cfg.temperal_downsample[i] if i != last else False,
                      down=i != last) for i in range(len(cfg.dim_mult)))
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNormChannels(dims[-1], 3)
        self.conv_out = CausalConv3d(dims[-1], cfg.z_dim * 2, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.conv_in.cached(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out.cached(F.silu(self.norm_out(x)), cache)


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        mult = cfg.dim_mult
        dims = [cfg.decoder_dim * u for u in (mult[-1], *mult[::-1])]
        temporal = cfg.temperal_downsample[::-1]
        last = len(mult) - 1
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList(
            UpBlock(dims[i], dims[i + 1], cfg.num_res_blocks, temporal[i] if i != last else False, up=i != last)
            for i in range(len(mult)))
        self.norm_out = RMSNormChannels(dims[-1], 3)
        self.conv_out = CausalConv3d(dims[-1], cfg.out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache, first_chunk: bool) -> torch.Tensor:
        x = self.mid_block(self.conv_in.cached(x, cache), cache)
        for block in self.up_blocks:
            x = block(x, cache, first_chunk)
        return self.conv_out.cached(F.silu(self.norm_out(x)), cache)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    b, c, f, h, w = x.shape
    x = x.view(b, c, f, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, f, h // p, w // p)


def unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    b, cp, f, h, w = x.shape
    x = x.view(b, cp // (p * p), p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cp // (p * p), f, h * p, w * p)


class WanVAE(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.quant_conv = CausalConv3d(cfg.z_dim * 2, cfg.z_dim * 2, 1)
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder(cfg)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, 1/std) of the latent channels, shaped to broadcast over `[B, z, F, H, W]` (the reference's forms)."""
        mean = torch.tensor(self.config.latents_mean).view(1, -1, 1, 1, 1).to(like)
        inv_std = (1.0 / torch.tensor(self.config.latents_std)).view(1, -1, 1, 1, 1).to(like)
        return mean, inv_std

    def encode_mode(self, video: torch.Tensor) -> torch.Tensor:
        """Pixels `[B, 3, T, H, W]` in [-1, 1] -> the posterior's mean `[B, z, 1 + (T-1)//4, H/16, W/16]`, normalised."""
        x = patchify(video, self.config.patch_size) if self.config.patch_size else video
        cache, outs = FrameCache(), []
        for i in range(1 + (x.shape[2] - 1) // 4):
            cache.cursor = 0
            outs.append(self.encoder(x[:, :, :1] if i == 0 else x[:, :, 1 + 4 * (i - 1): 1 + 4 * i], cache))
        mean = self.quant_conv(torch.cat(outs, 2))[:, : self.config.z_dim]
        mu, inv_std = self._stats(mean)
        return (mean - mu) * inv_std

    def decode_chunk(self, latents: torch.Tensor, first: bool, cache: FrameCache) -> torch.Tensor:
        """Normalised latents of a chunk `[B, z, f, h, w]` -> its pixels in [-1, 1]; `cache` carries the context."""
        mu, inv_std = self._stats(latents)
        z = latents / inv_std + mu
        outs = []
        for i in range(z.shape[2]):  # frame by frame, the pointwise conv too: any chunking gives the same bits
            cache.cursor = 0
            outs.append(self.decoder(self.post_quant_conv(z[:, :, i: i + 1]), cache, first_chunk=first and i == 0))
        out = torch.cat(outs, 2)
        out = unpatchify(out, self.config.patch_size) if self.config.patch_size else out
        return out.clamp(-1.0, 1.0) if self.config.clip_output else out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decode_chunk(latents, True, FrameCache())
