"""Classifier-free guidance: how a request's conditional and unconditional velocities combine.

One request at a time (norms are per request, never across a batch). The rules follow BAGEL's:

- text guidance `v = v_uncond + scale * (v_cond - v_uncond)`, applied only when `scale > 1` and the
  step's sigma lies in the interval `(lo, hi]`; otherwise the conditional velocity is used as is
  (and the unconditional branches need not be computed at all);
- image guidance on top, when text guidance applies and `image_scale > 1`:
  `v = v_uncond_image + image_scale * (v - v_uncond_image)`;
- renorm, which rescales the guided velocity by `||v_cond|| / ||v||` clamped to `[renorm_min, 1]`:
  `global` (one norm over the request's whole latents, after both guidance steps), `channel` (a norm
  over the channel dim at each position, after both steps), `text_channel` (per position, after the
  text step only; the image step is not renormalised), `none`.
"""

from __future__ import annotations

import attrs
import torch

RENORM_MODES = ("none", "global", "channel", "text_channel")

#: Keeps a zero-velocity guided result from dividing by zero (BAGEL uses the same).
_EPS = 1e-8


@attrs.frozen
class Guidance:
    """One request's CFG settings; the defaults mean no guidance."""

    scale: float = 1.0
    image_scale: float = 1.0
    interval: tuple[float, float] = (0.0, 1.0)
    renorm: str = "none"
    renorm_min: float = 0.0
    channel_dim: int = -1

    def text_active(self, sigma: float) -> bool:
        """Whether text guidance applies at this sigma (so the text-unconditional branch is needed)."""
        lo, hi = self.interval
        return self.scale > 1.0 and lo < sigma <= hi

    def image_active(self, sigma: float) -> bool:
        """Whether image guidance applies too (so the image-unconditional branch is needed)."""
        return self.image_scale > 1.0 and self.text_active(sigma)


def _renormed(guided: torch.Tensor, reference: torch.Tensor, dim: int | None, floor: float) -> torch.Tensor:
    if dim is None:
        ratio = torch.linalg.vector_norm(reference) / (torch.linalg.vector_norm(guided) + _EPS)
    else:
        ratio = torch.linalg.vector_norm(reference, dim=dim, keepdim=True) / (
            torch.linalg.vector_norm(guided, dim=dim, keepdim=True) + _EPS
        )
    return guided * ratio.clamp(min=floor, max=1.0)


def combine(
    guidance: Guidance,
    sigma: float,
    v_cond: torch.Tensor,
    v_uncond: torch.Tensor | None = None,
    v_uncond_image: torch.Tensor | None = None,
) -> torch.Tensor:
    """The guided velocity of one request at one step (`v_cond` alone when guidance does not apply)."""
    if not guidance.text_active(sigma):
        return v_cond
    if v_uncond is None:
        raise ValueError("text guidance applies at this step but no unconditional velocity was given")
    image = guidance.image_active(sigma)
    if image and v_uncond_image is None:
        raise ValueError("image guidance applies at this step but no image-unconditional velocity was given")
    v = v_uncond + guidance.scale * (v_cond - v_uncond)
    if guidance.renorm == "text_channel":
        v = _renormed(v, v_cond, guidance.channel_dim, guidance.renorm_min)
        if image:
            v = v_uncond_image + guidance.image_scale * (v - v_uncond_image)
        return v
    if image:
        v = v_uncond_image + guidance.image_scale * (v - v_uncond_image)
    if guidance.renorm == "global":
        return _renormed(v, v_cond, None, guidance.renorm_min)
    if guidance.renorm == "channel":
        return _renormed(v, v_cond, guidance.channel_dim, guidance.renorm_min)
    return v
