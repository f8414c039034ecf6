"""The Thinker: a MoE decoder reading text, audio and image tokens (M-RoPE, deepstack), and its two encoders.

`Thinker` is the `kvcache` node's module (packed tokens, `positions` `[3, T]`, per-token `deepstack`
rows) and owns the encoders the stateless nodes run (`audio_tower`, `visual`), so the checkpoint's
`thinker.*` subtree loads into it as is: `model.{embed_tokens, layers, norm}`, `lm_head`,
`audio_tower.*`, `visual.*`.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.logits import lm_logits
from mstar_core.nn.qwen3_decoder import Qwen3Decoder
from mstar_qwen_omni.audio_encoder import AudioEncoder
from mstar_qwen_omni.config import ThinkerConfig
from mstar_qwen_omni.split import part_dimensions
from mstar_qwen_omni.vision_encoder import VisionEncoder


class ThinkerTextModel(Qwen3Decoder):
    def __init__(self, cfg: ThinkerConfig):
        super().__init__(cfg.text)
        self.embed_tokens = nn.Embedding(cfg.text.vocab_size, cfg.text.hidden_size)


class Thinker(nn.Module):
    """`forward(ids, positions, context, input_embeds=, deepstack=)` -> final hidden `[T, H]`; `compute_logits`.

    With `keep_layer` set (a model that speaks: the Talker's accept layer), `forward` returns `[T, 2H]`:
    the final hidden, then that layer's output, which the engine hands back per token as output
    `accept_hidden` (`compute_accept_hidden`) to calls that ask for rows; `compute_logits` reads the first half.
    """

    position_axes = 3
    call_inputs = {"deepstack": "token"}  # [T, K, H]: added after decoder layer k (zeros: no visual token)
    # LoRA adapters (mstar_core.nn.lora) target the decoder's linears only (the encoders run in node `encode`),
    # named as in the full checkpoint (`thinker.model.layers.0.self_attn.q_proj`)
    lora_scope = ("model.",)
    checkpoint_prefix = "thinker."

    def __init__(self, cfg: ThinkerConfig):
        super().__init__()
        self.thinker_config = cfg
        self.config = cfg.text
        self.model = ThinkerTextModel(cfg)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.audio_tower = AudioEncoder(cfg.audio)
        self.visual = VisionEncoder(cfg.vision)
        self.keep_layer: int | None = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def tensor_parallel_dimensions(self, expert_parallel: bool = False) -> dict[str, int]:
        """The sizes a tensor-parallel group must divide to split this node (heads, KV heads, experts or their
        columns, vocabulary); `mstar_qwen_omni.parallel` splits it by the same table."""
        return part_dimensions(self, "thinker", expert_parallel)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: AttentionContext,
        input_embeds: torch.Tensor | None = None,
        deepstack: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        hidden, kept = self.model.run(x, positions, context, deepstack, self.keep_layer)
        return hidden if kept is None else torch.cat((hidden, kept), dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(self.lm_head, hidden[..., : self.config.hidden_size])

    def compute_accept_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The `keep_layer` output of each row `[N, H]` (what the Talker projects at audio and image tokens)."""
        return hidden[..., self.config.hidden_size :].contiguous()  # a view would carry both halves between workers
