"""The modules behind BAGEL's graph nodes; each wraps part of one `Bagel` (weights shared, never copied).

- `ViTNode`, `VAEEncodeNode`, `VAEDecodeNode` (stateless): an image's ViT rows, its clean VAE-latent rows
  (flow time 0), and latents back to pixels;
- `UnderstandLLM` (kvcache, samples) writes every label and decodes text; `GenLLM` (kvcache, per-token
  `velocity`) reads those labels read-only in the flow loop. Both run the MoT LLM, rows routed by expert;
- `FlowInputs`, `PickBranch`, `SplitVelocities` (function): the per-step glue around the CFG branches.
"""

from __future__ import annotations

from typing import Any

import torch
from mstar_diffusion.guidance import Guidance
from torch import nn

from mstar_bagel.modeling import Bagel, latent_tokens, tokens_to_image
from mstar_bagel.parallel import llm_dimensions
from mstar_core.grammar import GrammarVocab
from mstar_core.nn.flux_vae import FluxAutoEncoder

#: The three cache labels, in branch order: full context, without the last text, without any image.
LABELS = ("main", "cfg_text", "cfg_img")


def _each(pixels: torch.Tensor, fn) -> torch.Tensor:
    """Apply `fn` to every image of a stacked `[B, 3, H, W]` batch (or to one `[3, H, W]`)."""
    if pixels.dim() == 3:
        return fn(pixels)
    return torch.stack([fn(p) for p in pixels])


class ViTNode(nn.Module):
    """`pixels` `[3, H, W]` in [-1, 1] (stacked `[B, ...]`) -> ViT rows in the LLM's width `[patches, hidden]`."""

    def __init__(self, bagel: Bagel):
        super().__init__()
        self.bagel = bagel

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return _each(pixels, self.bagel.vit_rows)


class VAEEncodeNode(nn.Module):
    """`pixels` `[3, H, W]` -> clean latent rows `[tokens, hidden]` (vae2llm + time 0 + grid position)."""

    def __init__(self, bagel: Bagel, vae: FluxAutoEncoder):
        super().__init__()
        self.bagel, self.vae = bagel, vae

    def _one(self, pixels: torch.Tensor) -> torch.Tensor:
        tokens = latent_tokens(self.vae, pixels, self.bagel.config.latent_patch_size)
        ids = self.bagel.latent_ids(pixels.shape[1], pixels.shape[2]).to(pixels.device)
        return self.bagel.latent_rows(tokens, 0.0, ids)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return _each(pixels, self._one)


class VAEDecodeNode(nn.Module):
    """Final latents `[rows*cols, p*p*z]` and `latent_grid` `[rows, cols]` -> the image `[H, W, 3]` uint8; resized
    to `output_size` `[H, W]` when given (an edit answers at its input's size, drawn on BAGEL's VAE grid)."""

    def __init__(self, vae: FluxAutoEncoder, patch: int):
        super().__init__()
        self.vae, self.patch = vae, patch

    def forward(self, latents: torch.Tensor, latent_grid: Any, output_size: Any = None) -> torch.Tensor:
        rows, cols = (int(v) for v in latent_grid)
        image = tokens_to_image(self.vae, latents.float(), rows, cols, self.patch)
        if output_size is None or tuple(int(v) for v in output_size) == tuple(image.shape[:2]):
            return image
        size = tuple(int(v) for v in output_size)
        chw = image.permute(2, 0, 1)[None].float()
        resized = torch.nn.functional.interpolate(chw, size=size, mode="bicubic", antialias=True, align_corners=False)
        return resized[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8)


class UnderstandLLM(nn.Module):
    """The `llm` node: the MoT LLM over packed rows (routing 0 = und, 1 = gen expert), logits for sampling."""

    def __init__(self, bagel: Bagel, grammar_vocab: GrammarVocab | None = None):
        super().__init__()
        self.bagel = bagel
        self.config = bagel.config.llm
        self.grammar_vocab = grammar_vocab  # the kvcache engine's vocabulary for sampling grammars (None: refused)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bagel.language_model.embed(ids)

    @property
    def tensor_parallel(self):
        """The LLM's rank group when it was loaded split (`mstar_bagel.parallel`), else None."""
        return getattr(self.bagel.language_model, "tensor_parallel", None)

    def tensor_parallel_dimensions(self, expert_parallel: bool = False) -> dict[str, int]:
        """The sizes a tensor-parallel group must divide to split the LLM (`mstar_bagel.parallel`)."""
        return llm_dimensions(self.bagel.language_model)

    def forward(self, input_ids, positions, context, /, *, input_embeds=None, routing=None) -> torch.Tensor:
        return self.bagel.language_model(input_ids, positions, context, input_embeds=input_embeds, routing=routing)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.bagel.language_model.compute_logits(hidden)


class GenLLM(UnderstandLLM):
    """The `llm_gen` node: the same LLM in generation mode, a velocity (`llm2vae`) per returned row."""

    def compute_velocity(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.bagel.velocity(hidden)


class FlowInputs:
    """Function node, once per flow step: the latent rows the branches feed the LLM, and how many branches run.

    Branches follow upstream BAGEL: outside the CFG interval, or with a text scale <= 1, only the
    conditional one (`main`); inside, `cfg_text` too, and `cfg_img` when the image scale is > 1.
    """

    def __init__(self, bagel: Bagel):
        self.bagel = bagel

    def __call__(self, latents, timestep, sigma, latent_ids, guidance_scale=1.0, image_guidance_scale=1.0,
                 cfg_interval=(0.0, 1.0)):
        with torch.no_grad():
            rows = self.bagel.latent_rows(latents, timestep, latent_ids)
        g = Guidance(float(guidance_scale), float(image_guidance_scale), tuple(float(v) for v in cfg_interval))
        count = 1 + int(g.text_active(float(sigma))) + int(g.image_active(float(sigma)))
        return {"latent_rows": rows, "cfg_branches": count}


class PickBranch:
    """Function node inside a CFG branch: that branch's RoPE positions (each label ends at its own position)."""

    def __call__(self, gen_position_table: torch.Tensor, cfg_branch: int) -> torch.Tensor:
        return gen_position_table[cfg_branch]


class SplitVelocities:
    """Function node: the branches' velocities (in `LABELS` order) under the names the Euler node reads."""

    def __call__(self, branch_velocities: list) -> dict[str, Any]:
        v = list(branch_velocities) + [None] * (3 - len(branch_velocities))
        return {"velocity": v[0], "velocity_uncond": v[1], "velocity_uncond_image": v[2]}


class PickPart:
    """Function node in the understanding loop: part `index` (an image or a text block), with a 1/0 count per kind."""

    def __call__(self, parts: list, index: int) -> dict[str, Any]:
        part = parts[index]
        image = "vit_pixels" in part
        blank = torch.zeros(1, dtype=torch.long)  # the skipped kind's inputs: never read (its fan-out runs 0 times)
        out = {"part_is_image": int(image), "part_is_text": int(not image), "vit_pixels": None, "vit_block_ids": blank,
               "vit_block_at": blank, "vit_block_positions": blank, "text_ids": blank, "text_positions": blank}
        out.update(part)
        return out


class Detokenize:
    """Function node: the reply's text from its token ids, up to (not including) <|im_end|>."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, first_token: int, decoded: list) -> str:
        return self.tokenizer.decode([int(first_token), *(int(t) for t in decoded)], skip_special_tokens=True)


class ThinkClose:
    """Function node after a thought: the <|im_end|> that closes it, and each label's position for the image.

    The thought's tokens went into `main` as they were fed back (all but the last sampled one), so the
    image block starts after them and the closing <|im_end|>; `cfg_text` and `cfg_img` never saw the thought.
    """

    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, decoded: list, gen_position_base: list, gen_block_ids: torch.Tensor) -> dict[str, Any]:
        main, cfg_text, cfg_img = gen_position_base
        table = torch.tensor([main + len(decoded) + 1, cfg_text, cfg_img])[:, None].expand(3, gen_block_ids.numel())
        return {"close_ids": [self.eos], "gen_position_table": table.contiguous()}
