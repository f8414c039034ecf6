"""The Qwen3-TTS Talker: a dense Qwen3 decoder over codec frames, its text embedding + projection, and the shared
code predictor.

`Talker` is a `kvcache` node module: `input_embeds` (text and codec rows built outside), 1-D positions (the
checkpoint's interleaved M-RoPE with three equal position streams is 1-D RoPE), `codec_head` logits with the top
1024 ids suppressed except EOS. Checkpoint names: `talker.model.{layers, norm, codec_embedding, text_embedding}`,
`talker.{text_projection.linear_fc1/2, codec_head, code_predictor}`.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.code_predictor import CodePredictor, ResizeMLP
from mstar_core.nn.qwen3_decoder import Qwen3Decoder
from mstar_qwen_tts.config import TalkerConfig


class TalkerModel(Qwen3Decoder):
    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.text)
        self.codec_embedding = nn.Embedding(cfg.text.vocab_size, cfg.text.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class Talker(nn.Module):
    """`forward(None, positions, context, input_embeds=)` -> normed hidden `[T, H]`; `compute_logits` -> code 0 logits."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.talker_config = cfg
        self.config = cfg.text
        self.model = TalkerModel(cfg)
        self.text_projection = ResizeMLP(cfg.text_hidden_size, cfg.text_hidden_size, cfg.text.hidden_size,
                                         cfg.text.hidden_act)
        self.codec_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.predictor, cfg.text.hidden_size)
        suppressed = torch.zeros(cfg.text.vocab_size, dtype=torch.bool, device="cpu")
        suppressed[cfg.suppress_from:] = True
        suppressed[cfg.codec_eos_token_id] = False
        self.suppressed = suppressed  # derived from the config, not a weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Text token ids -> their projected rows in the Talker's width."""
        return self.text_projection(self.model.text_embedding(ids))

    def codec_rows(self, codes: torch.Tensor) -> torch.Tensor:
        """Frames `[T, G]` of codes -> the sum of each frame's G embeddings `[T, H]` (code 0: the Talker's table,
        codes 1..G-1: the code predictor's)."""
        rows = self.embed(codes[:, 0])
        for g, table in enumerate(self.code_predictor.model.codec_embedding):
            rows = rows + table(codes[:, g + 1])
        return rows

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
