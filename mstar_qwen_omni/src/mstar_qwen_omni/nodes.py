"""The `function` / `stateless` glue between the three partitions (cheap, per request).

- `TalkerPrompt`: the Talker's prefill embeddings (see `reference.talker_prompt`).
- `FrameSeed` (shared, `mstar_core.nn.code_predictor`): [Talker hidden, embed(code 0)], the code predictor's
  first input each frame.
- `TextStart` / `FrameStep`: the text side of each Talker step, reading the Thinker's token stream one
  token ahead (a token is spoken only once a later one shows it was fed back), and the frame's codes.
- `Code2WavWindow`: one `LeftContextChunkPolicy` window of frames -> its new samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mstar_core.nn.codec_vocoder import WindowDecoder
from mstar_core.streaming import Chunk
from mstar_qwen_omni.checkpoint import QwenOmni
from mstar_qwen_omni.positions import prompt_positions
from mstar_qwen_omni.reference import talker_prompt, user_positions

#: Feed states carried between Talker steps: the held token id, or one of these.
NOTHING, ENDED = -1, -2


class PromptEncoder(nn.Module):
    """Audio, image and video parts -> the Thinker's rows at their placeholders and per-token deepstack rows.

    (The accept-layer states the Talker reads at media positions come back from the Thinker's prefill
    itself: the kvcache engine returns a sampling call's per-token outputs when the call asks.)
    """

    def __init__(self, model: QwenOmni):
        super().__init__()
        self.thinker = model.thinker
        t = model.config.thinker
        self.audio_id, self.image_id, self.video_id = t.audio_token_id, t.image_token_id, t.video_token_id

    def forward(self, prompt_ids: list[int], audio_features: list | None = None,
                image_patches: torch.Tensor | None = None, image_grid: torch.Tensor | None = None,
                video_patches: torch.Tensor | None = None, video_grid: torch.Tensor | None = None) -> dict[str, Any]:
        th = self.thinker
        device = th.lm_head.weight.device
        ids = torch.tensor(prompt_ids, device=device)
        with torch.no_grad():
            embeds = th.embed(ids)
            deep = None
            if audio_features:
                rows = torch.cat([th.audio_tower(f.to(device)) for f in audio_features])
                embeds[ids == self.audio_id] = rows.to(embeds.dtype)
            for patches, grid, token in ((image_patches, image_grid, self.image_id),
                                         (video_patches, video_grid, self.video_id)):
                if patches is None:
                    continue
                merged, stack = th.visual(patches.to(device), grid)
                embeds[ids == token] = merged.to(embeds.dtype)
                if deep is None:
                    deep = embeds.new_zeros(len(prompt_ids), stack.shape[1], stack.shape[2])
                deep[ids == token] = stack.to(embeds.dtype)
            at = (ids == self.audio_id) | (ids == self.image_id) | (ids == self.video_id)
        return {"mm_rows": embeds[at], "mm_at": at.cpu(), "mm_deepstack": deep}


class TalkerPrompt(nn.Module):
    """The Talker's prefill embeddings, and its M-RoPE positions when user turns hold images (else None).

    Modules registered here are the weights it uses, so a worker hosting it keeps exactly those.
    """

    def __init__(self, model: QwenOmni, text_embed: nn.Module):
        super().__init__()
        self.talker, self.text_embed = model.talker, text_embed
        self.config, self.model_ref = model.config, [model]  # a list: not a submodule (the Thinker may be released)

    def forward(self, prompt_ids: list[int], first_token: int, speaker: str, accept_hidden: torch.Tensor | None = None,
                 image_grid: torch.Tensor | None = None) -> dict[str, Any]:
        cfg = self.config
        with torch.no_grad():
            embeds = talker_prompt(self.model_ref[0], prompt_ids, int(first_token), speaker, accept_hidden,
                                   self.text_embed)
        positions = None
        if image_grid is not None:
            users = user_positions(prompt_ids, cfg.im_start_token_id, cfg.user_token_id)
            ids = [prompt_ids[i] for i in users] + [cfg.tts_pad_token_id] * (embeds.shape[0] - len(users))
            t = cfg.thinker
            positions = prompt_positions(ids, t.image_token_id, image_grid.tolist(), t.vision.spatial_merge_size,
                                         t.position_id_per_seconds)
        # ids under the prefill's embeddings: codec_pad, never sampled (suppressed), so the repetition penalty
        # counts only the codes the Talker speaks, as transformers' does
        return {"talker_in": embeds, "talker_positions": positions,
                "talker_ids": [cfg.talker.codec_pad_id] * embeds.shape[0]}


def _first(chunk: Chunk) -> int:
    return int(chunk.new_items[0]) if chunk.new_items else NOTHING


class TextStart:
    """The first reply token after the one in the prompt, or NOTHING when the Thinker stopped already."""

    def __call__(self, text: Chunk) -> int:
        return _first(text)


class FrameStep(nn.Module):
    """Frame k's codes (None past the end) and the Talker's next input: its codec embeddings plus the text part."""

    def __init__(self, model: QwenOmni, text_embed: nn.Module):
        super().__init__()
        cfg = model.config
        self.talker, self.text_embed = model.talker, text_embed
        self.codebook = model.talker.code_predictor.codebook
        self.pad_id, self.eos_id = cfg.tts_pad_token_id, cfg.tts_eos_token_id

    def _text(self, held: int, text: Chunk) -> tuple[int, int]:
        """(token to speak now, next feed state): the held token once a later one arrived, tts_eos at the end."""
        if held == ENDED:
            return self.pad_id, ENDED
        later = _first(text)
        if later == NOTHING:  # the stream ended: the held token was the last one sampled, never fed back
            return self.eos_id, ENDED
        return held, later

    def forward(self, code0: int, cp_codes: list[int], text: Chunk, feed: int,
                 talker_finish: str | None) -> dict[str, Any]:
        joined = [int(t) for t in cp_codes]
        with torch.no_grad():
            device = self.talker.codec_head.weight.device
            spoken, feed = self._text(int(feed), text)
            step = (self.talker.embed(torch.tensor(int(code0), device=device))
                    + self.talker.code_predictor.embed(torch.tensor(joined, device=device)).sum(0)
                    + self.talker.text_projection(self.text_embed(torch.tensor(spoken, device=device))))
        # the last sampled code 0 (EOS, or the one at the length limit) gets no frame
        codes = None if talker_finish is not None else torch.tensor([int(code0), *(j % self.codebook for j in joined)])
        return {"codes": codes, "step_embeds": step[None], "feed": feed}


class Code2WavWindow(WindowDecoder):
    """A window of frames (context first) -> the new frames' samples `[n]` (the shared `WindowDecoder` on Code2Wav)."""

    def __init__(self, model: QwenOmni):
        super().__init__(model.code2wav)
