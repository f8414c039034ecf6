"""Chat messages with text, audio and image parts -> the Thinker's prompt ids, media inputs and M-RoPE positions.

Turns are Qwen's (`<|im_start|>role\\n ... <|im_end|>\\n`, then `<|im_start|>assistant\\n`). An audio part
(16 kHz samples) becomes its log-mel features and `<|audio_start|>`, one `<|audio_pad|>` per encoder token,
`<|audio_end|>`; an image part (`[H, W, 3]` uint8) its patches and `<|vision_start|>`, one `<|image_pad|>`
per merged token, `<|vision_end|>`. Media keep the order in which the chat gives them. A `tokens` part (ids) goes
in as it is: an earlier reply's generated ids, so a conversation's next prompt matches the cached KV exactly.
A video part (frames `[F, H, W, 3]` uint8 sampled at `fps`) becomes patches over time and `<|vision_start|>`,
one `<|video_pad|>` per merged token, `<|vision_end|>`; its temporal patches sit 2 / fps seconds apart in M-RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from PIL import Image

from mstar_core.checkpoint.tokens import encode_ids
from mstar_core.errors import RequestError
from mstar_core.nn.vision_patch import ImagePatcher, patchify
from mstar_core.nn.whisper_features import LogMelFeatures
from mstar_qwen_omni.audio_encoder import audio_token_count
from mstar_qwen_omni.config import OmniConfig
from mstar_qwen_omni.positions import prompt_positions

ROLES = ("system", "user", "assistant")


@attrs.define
class Prompt:
    ids: list[int]
    positions: torch.Tensor  # [3, T]
    audio: list[torch.Tensor] = attrs.field(factory=list)  # log-mel [mel, frames] per audio part
    patches: list[torch.Tensor] = attrs.field(factory=list)  # [n, patch dims] per image part
    grids: list[list[int]] = attrs.field(factory=list)
    video_patches: list[torch.Tensor] = attrs.field(factory=list)  # [n, patch dims] per video part
    video_grids: list[list[int]] = attrs.field(factory=list)
    video_seconds: list[float] = attrs.field(factory=list)  # seconds between a video's temporal patches

    @property
    def has_media(self) -> bool:
        return bool(self.audio or self.patches or self.video_patches)


class PromptBuilder:
    def __init__(self, cfg: OmniConfig, tokenizer: Any, patcher: ImagePatcher | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        t = cfg.thinker
        self.features = LogMelFeatures(n_mels=t.audio.num_mel_bins)
        v = t.vision
        self.patcher = patcher or ImagePatcher(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                               merge_size=v.spatial_merge_size)

    def _text(self, text: str) -> list[int]:
        # the GIL released while a long text (7 MB of realtime instructions) is tokenized; one past the whole
        # context refused by its head alone
        return encode_ids(self.tokenizer, text, add_special_tokens=False,
                          most=self.cfg.thinker.text.max_position_embeddings, what="a text of the prompt")

    def _tokens(self, ids: Any, where: str) -> list[int]:
        t = self.cfg.thinker
        media = {t.audio_token_id, t.image_token_id, t.video_token_id}
        vocab = t.text.vocab_size
        if not isinstance(ids, list | tuple) or not all(isinstance(i, int) and 0 <= i < vocab and i not in media
                                                       for i in ids):
            raise RequestError(f"'{where}.ids' must be token ids in [0, {vocab}) without media placeholders",
                               param=f"{where}.ids")
        return [int(i) for i in ids]

    def _media(self, part: Any, where: str, prompt: Prompt) -> list[int]:
        t = self.cfg.thinker
        kind = part["type"]
        if kind == "audio":
            samples = torch.as_tensor(part.get("audio"), dtype=torch.float32).flatten()
            if samples.numel() < 1600 or not torch.isfinite(samples).all():
                raise RequestError(f"'{where}.audio' must be at least 0.1 s of finite 16 kHz samples",
                                   param=f"{where}.audio")
            feats = self.features(samples)
            prompt.audio.append(feats)
            n = audio_token_count(feats.shape[1], t.audio.n_window)
            return [t.audio_start_token_id, *[t.audio_token_id] * n, t.audio_end_token_id]
        if kind == "video":
            return self._video(part, where, prompt)
        image = part.get("image")
        try:
            patches, grid = self.patcher(image.numpy() if isinstance(image, torch.Tensor) else image)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"'{where}.image': {exc}", param=f"{where}.image") from None
        prompt.patches.append(patches)
        prompt.grids.append(grid)
        n = grid[0] * grid[1] * grid[2] // t.vision.spatial_merge_size**2
        return [t.vision_start_token_id, *[t.image_token_id] * n, t.vision_end_token_id]

    def _video(self, part: Mapping[str, Any], where: str, prompt: Prompt) -> list[int]:
        """Frames `[F, H, W, 3]` uint8 sampled at `fps` -> patches over time (temporal patches of 2 frames)."""
        t = self.cfg.thinker
        frames, fps = part.get("video"), part.get("fps", 2.0)
        frames = frames.numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not frames.shape[0]:
            raise RequestError(f"'{where}.video' must be frames [F, H, W, 3] uint8", param=f"{where}.video")
        if isinstance(fps, bool) or not isinstance(fps, int | float) or not 0 < fps <= 60:
            raise RequestError(f"'{where}.fps' must be the frames' sampling rate in (0, 60]", param=f"{where}.fps")
        patcher = self.patcher
        try:
            h, w = patcher.size_for(frames.shape[1], frames.shape[2])
        except ValueError as exc:
            raise RequestError(f"'{where}.video': {exc}", param=f"{where}.video") from None
        if (h, w) != frames.shape[1:3]:
            frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=Image.Resampling.BICUBIC))
                               for f in frames])
        x = torch.from_numpy(frames.astype(np.float32) / 255.0).permute(0, 3, 1, 2)
        mean = torch.tensor(list(patcher.image_mean)).view(1, 3, 1, 1)
        std = torch.tensor(list(patcher.image_std)).view(1, 3, 1, 1)
        patches, grid = patchify((x - mean) / std, patcher.patch_size, patcher.temporal_patch_size, patcher.merge_size)
        prompt.video_patches.append(patches)
        prompt.video_grids.append(grid)
        prompt.video_seconds.append(patcher.temporal_patch_size / float(fps))
        n = grid[0] * grid[1] * grid[2] // t.vision.spatial_merge_size**2
        return [t.vision_start_token_id, *[t.video_token_id] * n, t.vision_end_token_id]

    def __call__(self, messages: Sequence[Mapping[str, Any]]) -> Prompt:
        prompt = Prompt(ids=[], positions=torch.zeros(3, 0, dtype=torch.long))
        ids: list[int] = []
        text = ""  # text is tokenized in runs between media parts, as one string would be
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or m.get("role") not in ROLES:
                raise RequestError(f"'messages[{i}]' must be an object with role system, user or assistant",
                                   param=f"messages[{i}]")
            text += f"<|im_start|>{m['role']}\n"
            content = m.get("content")
            if isinstance(content, str):
                text += content
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    where = f"messages[{i}].content[{j}]"
                    if not isinstance(part, Mapping) or part.get("type") not in ("text", "audio", "image", "video",
                                                                              "tokens"):
                        raise RequestError(f"'{where}' must be a part {{type: text | audio | image | video | tokens, "
                                           "...}}",
                                           param=where)
                    if part["type"] == "tokens":  # an earlier reply's exact ids: the KV cache holds these
                        ids += self._text(text) if text else []
                        text = ""
                        ids += self._tokens(part.get("ids"), where)
                        continue
                    if part["type"] == "text":
                        if not isinstance(part.get("text"), str):
                            raise RequestError(f"'{where}.text' must be a string", param=f"{where}.text")
                        text += part["text"]
                        continue
                    ids += self._text(text) if text else []
                    text = ""
                    ids += self._media(part, where, prompt)
            else:
                raise RequestError(f"'messages[{i}].content' must be a string or a list of parts",
                                   param=f"messages[{i}].content")
            text += "<|im_end|>\n"
        ids += self._text(text + "<|im_start|>assistant\n")
        t = self.cfg.thinker
        prompt.ids = ids
        prompt.positions = prompt_positions(ids, t.image_token_id, prompt.grids, t.vision.spatial_merge_size,
                                            t.position_id_per_seconds, video_token_id=t.video_token_id,
                                            video_grids=prompt.video_grids, video_seconds_per_grid=prompt.video_seconds)
        return prompt
