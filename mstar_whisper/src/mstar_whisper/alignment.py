"""Token times from the alignment heads' cross-attention (the `align` function nodes of the Whisper graph).

A window's text tokens are teacher-forced through the decoder once more, as openai-whisper's `find_alignment` does:
`[SOT, language?, task?, <|notimestamps|>, text..., EOT]` over the window's encoder states. The cross-attention
weights of the checkpoint's alignment heads (`alignment_heads` of the generation config; without them, every head
of the later half of the layers, openai-whisper's default) are cut to the frames that hold audio, normalised over the
tokens, median-filtered along time (config.json's `median_filter_width`, 7) and averaged over the heads; dynamic time
warping then walks the cheapest monotone path through the negated matrix, and each token's start is the first audio
frame its row reaches.

The rows are those of `<|notimestamps|>` and the text (a row's attention says where the token it predicts begins),
so text token k spans [start of row k, start of row k + 1): openai-whisper's reading. The normalisation runs over
those rows only, as transformers' `_extract_token_timestamps` does. The pass is a plain dense forward of the shared
decoder module (no cache: one sequence, once); nothing here is an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mstar_whisper.config import WhisperTokens
from mstar_whisper.longform import split_window

#: seconds per encoder position (two mel frames of 10 ms)
TIME_PRECISION = 0.02
MEDIAN_FILTER_WIDTH = 7


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """The median over a sliding window of `width` (odd) along the last dimension, edges mirrored."""
    if width <= 0 or width % 2 != 1:
        raise ValueError("the median filter's width must be a positive odd number")
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    shape = x.shape
    flat = x.reshape(-1, 1, shape[-1])  # (reflect padding wants a batch and a channel)
    padded = F.pad(flat, (pad, pad), mode="reflect")
    return padded.unfold(-1, width, 1).sort()[0][..., pad].reshape(shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotone path through `cost [rows, cols]` from its top-left to its bottom-right corner.

    Cells on one anti-diagonal depend only on the two diagonals before it, so the accumulated costs are kept skewed
    (`acc[d, i]` is cell `(i, d - i)`, both counted from 1 past a border of infinities): each diagonal is then one
    vector step over contiguous slices (Whisper's ~200 x 1500 matrices in tens of milliseconds, where a cell-by-cell
    loop takes seconds). Costs accumulate in float32 and ties resolve as openai-whisper's and transformers' loops
    resolve them (diagonal only when strictly cheapest, then up, else left), so the path is the same one.
    """
    rows, cols = cost.shape
    diagonals = rows + cols + 1
    i_all, j_all = np.meshgrid(np.arange(1, rows + 1), np.arange(1, cols + 1), indexing="ij")
    skewed = np.zeros((diagonals, rows + 1))
    skewed[i_all + j_all, i_all] = cost
    acc = np.full((diagonals, rows + 1), np.inf, dtype=np.float32)
    trace = np.full((diagonals, rows + 1), -1, dtype=np.int8)
    acc[0, 0] = 0
    for d in range(2, diagonals):
        lo, hi = max(1, d - cols), min(rows, d - 1)
        c0, c1, c2 = acc[d - 2, lo - 1 : hi], acc[d - 1, lo - 1 : hi], acc[d - 1, lo : hi + 1]
        diag = (c0 < c1) & (c0 < c2)
        up = ~diag & (c1 < c0) & (c1 < c2)
        # (the float64 sum stored as float32, as the loops store it)
        acc[d, lo : hi + 1] = skewed[d, lo : hi + 1] + np.where(diag, c0, np.where(up, c1, c2))
        trace[d, lo : hi + 1] = np.where(diag, 0, np.where(up, 1, 2))
    i, j = rows, cols
    text, time = [], []
    while i > 0 or j > 0:
        text.append(i - 1)
        time.append(j - 1)
        step = 2 if i == 0 else 1 if j == 0 else trace[i + j, i]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        elif step == 2:
            j -= 1
        else:
            raise RuntimeError(f"dynamic time warping left cell ({i}, {j}) without a step")
    return np.array(text[::-1]), np.array(time[::-1])


def row_start_times(weights: torch.Tensor, frames: int, median_width: int = MEDIAN_FILTER_WIDTH) -> np.ndarray:
    """Cross-attention `[heads, rows, encoder positions]` -> each row's start in seconds (`frames`: mel frames of
    audio; positions past `frames // 2` are padding and left out)."""
    w = weights[..., : max(1, frames // 2)].float()
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    # (a frame every row attends alike has std 0: it carries no alignment, 0 rather than NaN)
    w = median_filter((w - mean) / std.clamp_min(1e-12), median_width)
    matrix = w.mean(dim=0)
    text, time = dtw(-matrix.double().cpu().numpy())
    jumps = np.pad(np.diff(text), (1, 0), constant_values=1).astype(bool)
    return time[jumps] * TIME_PRECISION


class _CaptureContext:
    """The dense pass's attention: causal self-attention over the one sequence, cross-attention over its encoder keys
    and values with the alignment heads' probabilities kept (`weights[(layer, head)]`: `[rows, positions]`).

    `kv[layer]`: keys `[heads, dim, positions]` and values `[heads, positions, dim]`, strided views of the
    projections (batched matmuls read them in place)."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], heads: Sequence[tuple[int, int]]):
        self.kv, self.heads = kv, heads
        self.weights: dict[tuple[int, int], torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                             scale=scale)
        return out.transpose(0, 1)

    def cross_attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        keys, values = self.kv[layer]
        probs = torch.softmax((q.transpose(0, 1).float() @ keys.float()) * scale, dim=-1)  # [heads, rows, positions]
        for lay, head in self.heads:
            if lay == layer:
                self.weights[(lay, head)] = probs[head]
        return (probs.to(values.dtype) @ values).transpose(0, 1)


def _keys_values(attention: Any, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A `CrossAttention`'s keys `[heads, dim, positions]` and values `[heads, positions, dim]` over `states`: its
    projections read as strided views (`project_kv` stacks them into one tensor, a copy this pass does not need)."""
    shape = (states.shape[0], attention.num_heads, attention.head_dim)
    return attention.k_proj(states).view(shape).permute(1, 2, 0), attention.v_proj(states).view(shape).permute(1, 0, 2)


def default_heads(layers: int, heads: int) -> tuple[tuple[int, int], ...]:
    """openai-whisper's alignment heads for a checkpoint that names none: every head of the later half of layers."""
    return tuple((layer, h) for layer in range(layers // 2, layers) for h in range(heads))


def alignment_weights(decoder: Any, states: torch.Tensor, ids: Sequence[int],
                      heads: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The alignment heads' cross-attention `[heads, len(ids), positions]` for `ids` teacher-forced over encoder
    `states [positions, d]`; layers after the last alignment head are not run."""
    last = max(layer for layer, _ in heads)
    with torch.inference_mode():
        states = states.to(decoder.embed_tokens.weight.dtype)
        kv = {i: _keys_values(decoder.layers[i].encoder_attn, states) for i in range(last + 1)}
        context = _CaptureContext(kv, heads)
        input_ids = torch.tensor(list(ids), dtype=torch.long, device=states.device)
        x = decoder.embed_tokens(input_ids) + decoder.embed_positions(torch.arange(len(ids), device=states.device))
        for layer in decoder.layers[: last + 1]:
            x = layer(x, context)
        return torch.stack([context.weights[h] for h in heads])


class WordAligner:
    """A window's decoded tokens -> `(token, start s, end s)` for each of its text tokens, window-relative (a
    `function` node; `[]` when the request asked for no word timestamps).

    `long_form`: align only the tokens of the segments the window keeps (its tail after the last timestamp pair is
    decoded again by the next window); a short request keeps all of its text.
    """

    def __init__(self, decoder: Any, tokens: WhisperTokens, *, long_form: bool):
        self.decoder, self.tokens, self.long_form = decoder, tokens, long_form
        c = decoder.config
        self.median_width = getattr(c, "median_filter_width", MEDIAN_FILTER_WIDTH)
        self.heads = tokens.alignment_heads or default_heads(c.decoder_layers, c.decoder_attention_heads)

    def kept_text(self, tokens: list[int]) -> list[int]:
        t = self.tokens
        if self.long_form:
            tokens = [tok for _, _, seg in split_window(tokens, t.timestamp_begin, t.eot, 0.0, 0).segments for tok in seg]
        return [tok for tok in tokens if tok < t.eot]

    def prompt(self, detected_language: int, language_token: int, task_token: int) -> list[int]:
        t = self.tokens
        language = detected_language if language_token < 0 else language_token
        return [t.sot, *([language] if t.languages else []), *([task_token] if task_token >= 0 else []),
                t.no_timestamps]

    def __call__(self, encoder_states: torch.Tensor, first_token: int, window_tokens: list[int], detected_language: int,
                 language_token: int, task_token: int, content_frames: int,
                 word_timestamps: bool) -> list[tuple[int, float, float]]:
        if not word_timestamps:
            return []
        text = self.kept_text([int(first_token), *(int(t) for t in window_tokens)])
        if not text:
            return []
        head = self.prompt(int(detected_language), int(language_token), int(task_token))
        states = encoder_states[0] if encoder_states.dim() == 3 else encoder_states
        weights = alignment_weights(self.decoder, states, [*head, *text, self.tokens.eot], self.heads)
        # rows of <|notimestamps|> and the text: row k's start is text token k's start, row k + 1's its end
        starts = row_start_times(weights[:, len(head) - 1 : -1], int(content_frames), self.median_width)
        return [(tok, float(starts[k]), float(starts[k + 1])) for k, tok in enumerate(text)]
