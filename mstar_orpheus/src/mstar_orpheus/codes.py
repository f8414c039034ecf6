"""Orpheus audio tokens -> SNAC codes, and the reference decoder's windowing (`orpheus_tts/decoder.py`).

Audio tokens are `<custom_token_N>` ids: id = base + offset + slot * codebook_size + code, where
slot = i mod 7 and i counts only the audio tokens kept so far. A frame is 7 tokens: level 0 takes
slot 0, level 1 slots 1 and 4, level 2 slots 2, 3, 5 and 6 (the three SNAC levels at strides 4, 2, 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

TOKENS_PER_FRAME = 7
WINDOW_TOKENS = 28
STRIDE_TOKENS = 7
_LEVEL_SLOTS = ((0,), (1, 4), (2, 3, 5, 6))


@attrs.frozen
class AudioTokenMap:
    """Where audio codes live in the LM vocabulary; base and codebook size come from the checkpoint."""

    base: int = 128256
    offset: int = 10
    codebook_size: int = 4096

    @property
    def first(self) -> int:
        """Smallest audio token id."""
        return self.base + self.offset

    @property
    def end(self) -> int:
        """One past the largest audio token id."""
        return self.first + TOKENS_PER_FRAME * self.codebook_size

    def is_audio(self, token_id: int) -> bool:
        """Whether a generated id is an audio token (the streaming edge keeps only these)."""
        return self.first <= int(token_id) < self.end

    def code(self, token_id: int, index: int) -> int:
        """SNAC code of the `index`-th kept audio token (may fall outside [0, codebook) if mis-slotted)."""
        return int(token_id) - self.first - (index % TOKENS_PER_FRAME) * self.codebook_size


def tokens_to_codes(
    token_ids: Sequence[int], start: int, tokens: AudioTokenMap
) -> list[torch.Tensor] | None:
    """Codes per SNAC level (`[1, n]`, `[1, 2n]`, `[1, 4n]`) for whole frames of kept audio tokens.

    `start` is the kept-token index of `token_ids[0]` (a multiple of 7 for frame-aligned windows).
    Returns None when a code falls outside the codebook, as the reference skips such windows.
    """
    if start % TOKENS_PER_FRAME:
        raise ValueError(f"window start {start} is not frame-aligned (a multiple of {TOKENS_PER_FRAME})")
    frames = len(token_ids) // TOKENS_PER_FRAME
    ids = torch.tensor([int(t) for t in token_ids[: frames * TOKENS_PER_FRAME]], dtype=torch.long)
    slots = torch.arange(len(ids)) % TOKENS_PER_FRAME
    codes = ids - tokens.first - slots * tokens.codebook_size
    if len(codes) == 0 or bool(((codes < 0) | (codes >= tokens.codebook_size)).any()):
        return None
    per_frame = codes.view(frames, TOKENS_PER_FRAME)
    return [per_frame[:, list(s)].reshape(1, -1) for s in _LEVEL_SLOTS]


def window_slice(hop_length: int) -> slice:
    """Samples the reference emits per window: the second frame, [2048:4096] at hop 512."""
    frame = 4 * hop_length  # level-0 codes are held 4 latent steps (vq stride 4)
    return slice(frame, 2 * frame)


def reference_windows(token_ids: Sequence[int], tokens: AudioTokenMap) -> list[tuple[int, list[int]]]:
    """(start, 28 kept tokens) for each window the reference decoder decodes, in order.

    After every 7th kept token, once at least 28 are buffered, the last 28 form a window.
    Non-audio ids are not kept and do not advance the count.
    """
    kept = [int(t) for t in token_ids if tokens.is_audio(t)]
    return [
        (count - WINDOW_TOKENS, kept[count - WINDOW_TOKENS : count])
        for count in range(WINDOW_TOKENS, len(kept) + 1, STRIDE_TOKENS)
    ]


def reference_audio(
    token_ids: Sequence[int],
    tokens: AudioTokenMap,
    decode_window: Callable[[Sequence[int], int], torch.Tensor | None],
) -> list[torch.Tensor]:
    """Offline reference: the audio each window emits, from the full token sequence."""
    out = []
    for start, window in reference_windows(token_ids, tokens):
        audio = decode_window(window, start)
        if audio is not None:
            out.append(audio)
    return out


def to_int16(audio: torch.Tensor) -> torch.Tensor:
    """The reference's int16 conversion: truncating `x * 32767`."""
    return (audio.float() * 32767).to(torch.int16)
