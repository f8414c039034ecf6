"""The Talker (MoE decoder over codec frames) and its code predictor (a small dense decoder, one head per group).

`Talker` is a `kvcache` node module: `input_embeds` only (text/hidden projections plus codec embeddings,
built outside), M-RoPE positions, `codec_head` logits with the top `1024` ids suppressed except EOS
(`TalkerConfig.suppress_from`). Checkpoint names: `talker.model.{layers, norm, codec_embedding}`,
`talker.{text_projection, hidden_projection, codec_head, code_predictor}`.

`CodePredictor` (shared with Qwen3-TTS: `mstar_core.nn.code_predictor`) predicts codes 1..G-1 of a frame.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.code_predictor import CodePredictor, CodePredictorModel, ResizeMLP
from mstar_core.nn.qwen3_decoder import Qwen3Decoder
from mstar_qwen_omni.config import TalkerConfig
from mstar_qwen_omni.split import part_dimensions

__all__ = ["CodePredictor", "CodePredictorModel", "ResizeMLP", "Talker", "TalkerModel"]


class TalkerModel(Qwen3Decoder):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.text)
        self.codec_embedding = nn.Embedding(cfg.text.vocab_size, cfg.text.hidden_size)


class Talker(nn.Module):
    """`forward(None, positions, context, input_embeds=)` -> normed hidden `[T, H]`; `compute_logits` -> code 0 logits."""

    position_axes = 3

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.talker_config = cfg
        self.config = cfg.text
        self.model = TalkerModel(cfg)
        resize = (cfg.thinker_hidden_size, cfg.text.intermediate_size, cfg.text.hidden_size, cfg.text.hidden_act)
        self.text_projection = ResizeMLP(*resize)
        self.hidden_projection = ResizeMLP(*resize)
        self.codec_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.predictor)
        suppressed = torch.zeros(cfg.text.vocab_size, dtype=torch.bool, device="cpu")
        suppressed[cfg.suppress_from:] = True
        suppressed[cfg.codec_eos_token_id] = False
        self.suppressed = suppressed  # derived from the config, not a weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def tensor_parallel_dimensions(self, expert_parallel: bool = False) -> dict[str, int]:
        """The sizes a tensor-parallel group must divide to split this node (heads, KV heads, experts or their
        columns, vocabulary); `mstar_qwen_omni.parallel` splits it by the same table."""
        return part_dimensions(self, "talker", expert_parallel)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: AttentionContext,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        hidden, _ = self.model.run(x, positions, context)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.codec_head(hidden)
        return logits.masked_fill(self.suppressed.to(logits.device), float("-inf"))
