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

from mstar_core.nn.code_predictor import ResizeMLP
from mstar_core.nn.qwen3_talker import Qwen3Talker, Qwen3TalkerModel
from mstar_qwen_tts.config import TalkerConfig


class TalkerModel(Qwen3TalkerModel):
    """The shared decoder and code-0 table, plus the Talker's own text table (Omni's Talker reads the Thinker's)."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class Talker(Qwen3Talker):
    """The shared Talker with the text projection; the code predictor takes its inputs in the Talker's width."""

    model: TalkerModel
    text_projection: ResizeMLP

    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg, TalkerModel(cfg), {
            "text_projection": ResizeMLP(cfg.text_hidden_size, cfg.text_hidden_size, cfg.text.hidden_size,
                                         cfg.text.hidden_act),
        }, predictor_width=cfg.text.hidden_size)

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
