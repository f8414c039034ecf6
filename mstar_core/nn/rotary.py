"""Rotary position embeddings: frequency tables (default, linear, llama3) and their application.

Frequencies are computed in fp32 on the CPU at construction (explicit device, so building a model
under `torch.device("meta")` still yields real tables) and kept as a plain attribute rather than a
buffer: they are derived from the config, never read from a checkpoint. 3-D and M-RoPE variants
subclass `RotaryEmbedding` and override `forward` to take `[S, T]` position ids, splitting the
frequency table into per-axis sections.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mstar_core.config.hf import merged_rope_keys
from mstar_core.nn import cpu_elementwise

RopeInit = Callable[[Mapping[str, Any], int], tuple[torch.Tensor, float]]


def _base_inv_freq(params: Mapping[str, Any], dim: int) -> torch.Tensor:
    theta = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (theta**exponents)


def _default(params: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params, dim), 1.0


def _linear(params: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    # Stretching positions by `factor` is the same as shrinking every frequency by it.
    return _base_inv_freq(params, dim) / float(_require(params, "factor")), 1.0


def _llama3(params: Mapping[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, a smooth ramp between."""
    inv_freq = _base_inv_freq(params, dim)
    factor = float(_require(params, "factor"))
    low = float(_require(params, "low_freq_factor"))
    high = float(_require(params, "high_freq_factor"))
    original = float(_require(params, "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    # ramp = 0 at wavelen >= original/low (fully scaled), 1 at wavelen <= original/high (unscaled).
    ramp = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - ramp) * (inv_freq / factor) + ramp * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, scaled)
    scaled = torch.where(wavelen < original / high, inv_freq, scaled)
    return scaled, 1.0


#: Rows of the cached CPU tables: the first size, and the largest (positions beyond it are computed each time)
MIN_TABLE_ROWS = 1024
MAX_TABLE_ROWS = 1 << 17

ROPE_INIT: dict[str, RopeInit] = {"default": _default, "linear": _linear, "llama3": _llama3}


def _require(params: Mapping[str, Any], key: str) -> Any:
    if key not in params:
        kind = params.get("rope_type", "default")
        raise ValueError(f"rope scaling {kind!r} needs '{key}' in rope_scaling/rope_parameters")
    return params[key]


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """Merge a HF config's `rope_theta` and `rope_scaling` / `rope_parameters` into one dict with `rope_type`."""
    params = merged_rope_keys(config, lambda key: ValueError(
        f"config key '{key}' must be a mapping or null, got {type(config[key]).__name__}"))
    kind = params["rope_type"]
    if kind not in ROPE_INIT:
        raise ValueError(f"unsupported rope_type {kind!r} (config key 'rope_scaling'); known: {sorted(ROPE_INIT)}")
    ROPE_INIT[kind](params, 2)  # fail now, naming a missing scaling key, not when the model is built
    return params


class RotaryEmbedding(nn.Module):
    """Maps `[T]` position ids to `(cos, sin)` tables of shape `[T, rotary_dim]` (half-split layout)."""

    def __init__(self, head_dim: int, params: Mapping[str, Any] | None = None):
        super().__init__()
        params = dict(params or {"rope_type": "default"})
        self.rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        kind = params.get("rope_type", "default")
        inv_freq, self.attention_scaling = ROPE_INIT[kind](params, self.rotary_dim)
        self.inv_freq = inv_freq
        self.rope_type = kind
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) of CPU positions 0..n-1: see `_rows`

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1 and positions.is_cpu and positions.dtype == torch.long:
            return self._rows(positions)
        return self._tables_at(positions)

    def _tables_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) rows of `positions`, computed."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU positions' rows read from tables computed once for positions 0..n-1 (grown as positions grow).

        A decode step's rotary tables were ten torch ops a step (on a CPU, right after a replayed step has streamed
        every weight through the caches: ~0.1 ms at one row); here two row gathers. Every CPU step, eager, recorded or
        replayed, reads the same table, so they agree bit for bit; positions past `MAX_TABLE_ROWS` (or negative) are
        computed, as before.
        """
        table = self._table
        if table is not None:
            try:
                return table[0].index_select(0, positions), table[1].index_select(0, positions)
            except IndexError:  # (a position past the table: grow it below)
                pass
        if not positions.numel():
            return self._tables_at(positions)
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= MAX_TABLE_ROWS:
            return self._tables_at(positions)
        rows = max(MIN_TABLE_ROWS, 1 << high.bit_length())  # (doubling: a long prompt grows it a few times at most)
        with torch.inference_mode(False):  # (a plain tensor: read from inference mode and outside it alike)
            self._table = table = self._tables_at(torch.arange(min(rows, MAX_TABLE_ROWS)))
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, rope_type={self.rope_type}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, H, D]` by per-token `cos`/`sin` `[T, R]` (R <= D; the rest passes through)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.numel() == 0 else torch.cat((out, x_pass), dim=-1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary`, written into `x` itself where the CPU kernel runs (x must be the caller's scratch), else a new tensor."""
    return x if cpu_elementwise.rotary_(x, cos, sin) else apply_rotary(x, cos, sin)
