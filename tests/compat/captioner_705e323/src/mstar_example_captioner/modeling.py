"""The torch modules: a small ViT-style vision tower and the captioner that holds it next to a Llama decoder.

Nothing here knows about M*'s runtime. The decoder is `mstar_core.nn.LlamaForCausalLM`, which
already has the methods the `kvcache` engine calls (`forward(input_ids, positions, context,
input_embeds=None)`, `embed`, `compute_logits`, `config`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import MLP, LayerNorm, LlamaForCausalLM
from mstar_example_captioner.config import CaptionerConfig, VisionConfig


class VisionBlock(nn.Module):
    """Pre-norm transformer block with bidirectional attention over one image's patches."""

    def __init__(self, hidden: int, heads: int, intermediate: int):
        super().__init__()
        self.heads = heads
        self.norm1 = LayerNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = LayerNorm(hidden, eps=1e-6)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, h)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class VisionTower(nn.Module):
    """Pixels `[B, 3, S, S]` (normalised) -> one embedding row per patch, in the decoder's width: `[B, N, H_text]`."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.patch_size = cfg.patch_size
        self.patch_embed = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size)
        self.position_embedding = nn.Parameter(torch.zeros(cfg.num_patches, cfg.hidden_size))
        self.layers = nn.ModuleList(
            VisionBlock(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size) for _ in range(cfg.num_layers)
        )
        self.post_norm = LayerNorm(cfg.hidden_size, eps=1e-6)
        self.projector = MLP(cfg.hidden_size, text_hidden, out=text_hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        b, c = pixels.shape[:2]
        patches = pixels.to(self.patch_embed.weight.dtype).unfold(2, p, p).unfold(3, p, p)  # [B, C, gh, gw, p, p]
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        x = self.patch_embed(patches) + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        return self.projector(self.post_norm(x))


class Captioner(nn.Module):
    """Both components under the checkpoint's names: `vision_tower.*` and `language_model.*`."""

    def __init__(self, cfg: CaptionerConfig):
        super().__init__()
        self.config = cfg
        self.vision_tower = VisionTower(cfg.vision, cfg.text.hidden_size)
        self.language_model = LlamaForCausalLM(cfg.text)


class ImageSplicer:
    """The `splice` node's module (engine `function`): prompt token embeddings with image rows at the placeholders.

    The `kvcache` engine takes `input_embeds` with one row per input id and uses those rows
    instead of its own token embeddings, so text rows must be real token embeddings too.
    """

    def __init__(self, lm: LlamaForCausalLM, image_token_id: int):
        self.lm = lm
        self.image_token_id = image_token_id

    def __call__(self, input_ids: list[int], global_embeds: torch.Tensor, detail_embeds: torch.Tensor) -> torch.Tensor:
        # the function engine runs modules as they are: no inference mode, so no autograd here either
        with torch.no_grad():
            ids = torch.tensor(input_ids, device=self.lm.model.embed_tokens.weight.device)
            embeds = self.lm.embed(ids)
            image = torch.cat([global_embeds, detail_embeds]).to(embeds)
            slots = ids == self.image_token_id
            if int(slots.sum()) != image.shape[0]:
                raise ValueError(f"prompt has {int(slots.sum())} image placeholders for {image.shape[0]} image rows")
            embeds[slots] = image
            return embeds
