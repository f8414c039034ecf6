"""The `function` glue between the Talker, its code predictor and the speech decoder (cheap, per request).

- `TalkerPrompt`: the Talker's prefill rows and the text rows of its later steps (`prompt.talker_rows`; a cloned
  voice with its transcript adds the in-context block of its reference codes).
- `FrameStep`: frame k's codes and the Talker's next input: the sum of its 16 codec embeddings plus text row k.
(`FrameSeed` and the speech decoder's window node are Qwen3-Omni's, shared through `mstar_core.nn`.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar_qwen_tts.config import TTSConfig
from mstar_qwen_tts.prompt import talker_rows
from mstar_qwen_tts.talker import Talker


class TalkerPrompt(nn.Module):
    def __init__(self, talker: Talker, cfg: TTSConfig):
        super().__init__()
        self.talker, self.cfg = talker, cfg

    def forward(self, text_ids: list[int], instruct_ids: list[int], speaker: str, language: str,
                non_streaming: bool, speaker_embedding: torch.Tensor | None = None,
                ref_ids: list[int] | None = None, ref_codes: torch.Tensor | None = None) -> dict[str, Any]:
        prefill, trailing = talker_rows(self.talker, self.cfg, text_ids, instruct_ids, speaker, language,
                                        bool(non_streaming), speaker_embedding, ref_ids, ref_codes)
        # ids under the prefill rows: codec pad, never sampled (suppressed), so the repetition penalty counts only
        # the codes the Talker speaks, as the upstream generate does
        return {"talker_in": prefill, "talker_ids": [self.cfg.talker.codec_pad_id] * prefill.shape[0],
                "trailing": trailing, "text_step": 0}


class FrameStep(nn.Module):
    """Frame k's codes (None past the end), the Talker's next input and the sampling of its next code 0;
    `text_step` counts the steps taken."""

    def __init__(self, talker: Talker):
        super().__init__()
        self.talker = talker
        self.codebook = talker.code_predictor.codebook

    def forward(self, code0: int, cp_codes: list[int], trailing: torch.Tensor, text_step: int,
                talker_finish: str | None, talker_sampling: Any, talker_opening_sampling: Any) -> dict[str, Any]:
        joined = [int(t) for t in cp_codes]
        step = int(text_step)
        with torch.no_grad():
            device = self.talker.codec_head.weight.device
            row = (self.talker.embed(torch.tensor(int(code0), device=device))
                   + self.talker.code_predictor.embed(torch.tensor(joined, device=device)).sum(0)
                   + trailing[min(step, trailing.shape[0] - 1)].to(device))
        # the last sampled code 0 (EOS, or the one at the length limit) gets no frame
        codes = None if talker_finish is not None else torch.tensor([int(code0), *(j % self.codebook for j in joined)])
        # the Talker's second code 0 (this step's) may not be EOS either: the upstream `min_new_tokens` 2
        sampling = talker_opening_sampling if step == 0 else talker_sampling
        return {"codes": codes, "step_embeds": row[None], "text_step": step + 1, "step_sampling": sampling}
