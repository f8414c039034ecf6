"""BAGEL the upstream way, dense and single-request: the baseline M*'s cached path must equal (tests, benchmark).

Each cache label is its own `DenseKVCache` (mstar_core.nn): a snapshot is a deep copy of another's keys and values, the CFG
branches run as separate forwards, and every flow step concatenates the branch's cached keys and values
with the step's own (nothing paged, nothing shared). Guidance follows upstream BAGEL's formulas directly.
"""

from __future__ import annotations

import torch
from mstar_diffusion.schedules import flow_euler

from mstar_bagel.modeling import Bagel, latent_tokens, tokens_to_image
from mstar_core.nn.attention import DenseKVCache
from mstar_core.nn.flux_vae import FluxAutoEncoder
from mstar_core.nn.sincos import flattened_grid_ids


class Label:
    """A dense cache and the RoPE position its next block starts at."""

    def __init__(self, cache: DenseKVCache | None = None, position: int = 0):
        self.cache, self.position = cache or DenseKVCache(), position

    def copy(self) -> Label:
        return Label(self.cache.copy(), self.position)


@torch.inference_mode()
def prefill_text(bagel: Bagel, label: Label, ids: list[int]) -> None:
    n = len(ids)
    label.cache.write, label.cache.bidirectional = True, False
    bagel.language_model(torch.tensor(ids), torch.arange(label.position, label.position + n), label.cache)
    label.position += n


@torch.inference_mode()
def decode_greedy(bagel: Bagel, label: Label, first: list[int], max_tokens: int, stops: tuple[int, ...],
                  bias: dict[int, float] | None = None) -> list[int]:
    """Feed `first`, then each argmax token (after adding `bias` to the logits) back, until a stop id or
    `max_tokens` sampled; the sampled ids."""
    lm, out, ids = bagel.language_model, [], first
    label.cache.write, label.cache.bidirectional = True, False
    while True:
        n = len(ids)
        hidden = lm(torch.tensor(ids), torch.arange(label.position, label.position + n), label.cache)
        label.position += n
        logits = lm.compute_logits(hidden[-1:]).float()
        for t, b in (bias or {}).items():
            logits[..., t] += b
        token = int(logits.argmax(-1))
        out.append(token)
        if token in stops or len(out) >= max_tokens:
            return out
        ids = [token]


@torch.inference_mode()
def prefill_block(bagel: Bagel, label: Label, boi: int, eoi: int, rows: torch.Tensor, gen: bool) -> None:
    """[BOI, rows, EOI] at one position, bidirectional; `gen` routes the rows to the generation expert."""
    lm = bagel.language_model
    n = rows.shape[0]
    x = torch.cat([lm.embed(torch.tensor([boi])), rows.to(lm.lm_head.weight.dtype), lm.embed(torch.tensor([eoi]))])
    routing = torch.tensor([0] + [1] * n + [0]) if gen else None
    label.cache.write, label.cache.bidirectional = True, True
    lm(None, torch.full((n + 2,), label.position), label.cache, input_embeds=x, routing=routing)
    label.position += 1


@torch.inference_mode()
def branch_velocity(bagel: Bagel, label: Label, boi: int, eoi: int, latent_rows: torch.Tensor) -> torch.Tensor:
    """One branch's velocity: the latent block read-only over the label's cache (nothing stored)."""
    lm = bagel.language_model
    n = latent_rows.shape[0]
    x = torch.cat([lm.embed(torch.tensor([boi])), latent_rows, lm.embed(torch.tensor([eoi]))])
    label.cache.write, label.cache.bidirectional = False, True
    hidden = lm(None, torch.full((n + 2,), label.position), label.cache, input_embeds=x,
                routing=torch.tensor([0] + [1] * n + [0]))
    label.cache.write = True
    return bagel.velocity(hidden[1:-1])


def _renorm(v: torch.Tensor, ref: torch.Tensor, dim: int | None, floor: float) -> torch.Tensor:
    if dim is None:
        scale = torch.norm(ref) / (torch.norm(v) + 1e-8)
    else:
        scale = torch.norm(ref, dim=dim, keepdim=True) / (torch.norm(v, dim=dim, keepdim=True) + 1e-8)
    return v * scale.clamp(min=floor, max=1.0)


def guided(v, v_text, v_img, text_scale, img_scale, renorm, floor):
    """Upstream BAGEL's combination (text step, then image step; renorm global / channel / text_channel)."""
    if text_scale <= 1.0:
        return v
    if renorm == "text_channel":
        vt = _renorm(v_text + text_scale * (v - v_text), v, -1, floor)
        return v_img + img_scale * (vt - v_img) if img_scale > 1.0 else vt
    out = v_text + text_scale * (v - v_text)
    if img_scale > 1.0:
        out = v_img + img_scale * (out - v_img)
    if renorm == "global":
        return _renorm(out, v, None, floor)
    if renorm == "channel":
        return _renorm(out, v, -1, floor)
    return out


@torch.inference_mode()
def generate(bagel: Bagel, labels: dict[str, Label], boi: int, eoi: int, rows: int, cols: int, *, num_steps: int,
             shift: float, seed: int, text_scale: float, img_scale: float, interval, renorm: str, floor: float = 0.0):
    """The flow loop over frozen labels: latents `[rows*cols, p*p*z]` after `num_steps` Euler steps."""
    cfg = bagel.config
    n = rows * cols
    x = torch.randn((n, cfg.patch_latent_dim), generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    ids = flattened_grid_ids(rows, cols, cfg.max_latent_size)
    sigmas = flow_euler(num_steps, shift).to(torch.float32)
    lo, hi = interval
    for i in range(num_steps):
        sigma = sigmas[i]
        rows_in = bagel.latent_rows(x, sigma, ids)
        v = branch_velocity(bagel, labels["main"], boi, eoi, rows_in).float()
        inside = lo < float(sigma) <= hi
        ts, ims = (text_scale, img_scale) if inside else (1.0, 1.0)
        v_text = branch_velocity(bagel, labels["cfg_text"], boi, eoi, rows_in).float() if ts > 1.0 else None
        v_img = branch_velocity(bagel, labels["cfg_img"], boi, eoi, rows_in).float() if ts > 1.0 and ims > 1.0 else None
        v = guided(v, v_text, v_img, ts, ims, renorm, floor)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


@torch.inference_mode()
def t2i_labels(bagel: Bagel, prompt_ids: list[int]) -> dict[str, Label]:
    main = Label()
    cfg_text = main.copy()
    prefill_text(bagel, main, prompt_ids)
    return {"main": main, "cfg_text": cfg_text, "cfg_img": main.copy()}


@torch.inference_mode()
def edit_labels(bagel: Bagel, vae: FluxAutoEncoder, vae_pixels: torch.Tensor, vit_pixels: torch.Tensor,
                prompt_ids: list[int], boi: int, eoi: int) -> dict[str, Label]:
    cfg = bagel.config
    main = Label()
    tokens = latent_tokens(vae, vae_pixels, cfg.latent_patch_size)
    vae_rows = bagel.latent_rows(tokens, 0.0, bagel.latent_ids(*vae_pixels.shape[1:]))
    prefill_block(bagel, main, boi, eoi, vae_rows, gen=True)
    prefill_block(bagel, main, boi, eoi, bagel.vit_rows(vit_pixels), gen=False)
    cfg_text = main.copy()
    prefill_text(bagel, main, prompt_ids)
    cfg_img = Label()
    prefill_text(bagel, cfg_img, prompt_ids)
    return {"main": main, "cfg_text": cfg_text, "cfg_img": cfg_img}


def decode(vae: FluxAutoEncoder, latents: torch.Tensor, rows: int, cols: int, patch: int) -> torch.Tensor:
    with torch.inference_mode():
        return tokens_to_image(vae, latents, rows, cols, patch)
