"""Dense greedy speech generation with M*'s modules: the algorithm the walks implement, without any cache.

Every step re-runs the whole sequence (`DenseAttention`), so this is slow but plainly right; the served
graph is tested against it, and it is tested against transformers' `generate(return_audio=True)`.

The Talker's input, step by step (`talker_prompt`, `TextFeed`):
- prompt: every user-turn token of the chat (its `<|im_start|>user` ... up to the next `<|im_start|>`)
  as `text_projection(embedding)`, or `hidden_projection(layer-accept hidden)` for audio/image tokens;
  then the assistant prefix: its 3 role tokens projected (no codec part), 4 x `tts_pad` over codec
  [nothink, think_bos, think_eos, speaker], `tts_bos` over `codec_pad`, the first reply token over `codec_bos`.
- step k: the sum of frame k's codec embeddings (code 0 in the Talker's table, codes 1.. in the code
  predictor's) plus the text part: the projected reply token k + 1 while the Thinker fed it back (its
  last sampled token never is), then `tts_eos` once, then `tts_pad`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from mstar_core.nn.attention import DenseAttention
from mstar_qwen_omni.checkpoint import QwenOmni
from mstar_qwen_omni.positions import prompt_positions


def user_positions(ids: Sequence[int], im_start: int, user: int) -> list[int]:
    """Indices of the tokens inside user turns (from a turn's `<|im_start|>` up to the next one)."""
    out, in_user = [], False
    for i, t in enumerate(ids):
        if t == im_start:
            in_user = i + 1 < len(ids) and ids[i + 1] == user
        if in_user:
            out.append(i)
    return out


def last_assistant_start(ids: Sequence[int], im_start: int, assistant: int) -> int:
    starts = [i for i in range(len(ids) - 1) if ids[i] == im_start and ids[i + 1] == assistant]
    if not starts:
        raise ValueError("the prompt must end with an assistant turn's start (<|im_start|>assistant)")
    return starts[-1]


@torch.no_grad()
def talker_prompt(model: QwenOmni, ids: Sequence[int], first_token: int, speaker: str,
                  accept_hidden: torch.Tensor | None = None, text_embed: torch.nn.Module | None = None) -> torch.Tensor:
    """The Talker's prefill embeddings `[user tokens + 9, H]` (see the module docstring).

    `text_embed`: the Thinker's token embedding table (default: the Thinker's own; a process hosting only the
    Talker's side holds a copy, so the Thinker's weights need not stay there).
    """
    cfg, talker = model.config, model.talker
    embed = text_embed or model.thinker.model.embed_tokens
    t = cfg.thinker
    tensor_ids = torch.tensor(list(ids))
    users = user_positions(ids, cfg.im_start_token_id, cfg.user_token_id)
    mm = {t.audio_token_id, t.image_token_id, t.video_token_id}
    rows = []
    for i in users:
        if ids[i] in mm:
            if accept_hidden is None:
                raise ValueError("a prompt with audio or images needs the Thinker's accept-layer hidden states")
            rows.append(talker.hidden_projection(accept_hidden[i]))
        else:
            rows.append(talker.text_projection(embed(tensor_ids[i])))
    start = last_assistant_start(ids, cfg.im_start_token_id, cfg.assistant_token_id)
    role = talker.text_projection(embed(tensor_ids[start : start + 3]))
    tts = talker.text_projection(embed(torch.tensor([cfg.tts_pad_token_id, cfg.tts_bos_token_id, first_token])))
    tc = cfg.talker
    codec = talker.embed(torch.tensor([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id,
                                       tc.speaker_id[speaker.lower()], tc.codec_pad_id, tc.codec_bos_id]))
    prefix = torch.cat([tts[0:1].expand(4, -1), tts[1:3]]) + codec
    return torch.cat([*(r.view(1, -1) for r in rows), role, prefix])


@attrs.define
class TextFeed:
    """The text part of the Talker's steps: reply tokens as the Thinker feeds them back, then tts_eos, then tts_pad.

    `push(token)` when the Thinker produced one more token, `end()` when it finished; `next()` gives the
    text part of the next Talker step, or None while the answer depends on a token not produced yet.
    """

    held: int | None = None
    ended: bool = False
    eos_sent: bool = False
    queue: list[int] = attrs.field(factory=list)

    def push(self, token: int) -> None:
        self.queue.append(token)

    def end(self) -> None:
        self.ended = True

    def next(self) -> str | int | None:
        """A token id to project, "eos", "pad", or None (wait for the Thinker)."""
        if self.eos_sent:
            return "pad"
        if self.held is None and self.queue:
            self.held = self.queue.pop(0)
        if self.held is not None and self.queue:  # a later token exists: the held one was fed back
            token, self.held = self.held, self.queue.pop(0)
            return token
        if self.ended:  # the held token (if any) was the last sampled one: never fed back
            self.eos_sent, self.held = True, None
            return "eos"
        return None


@torch.no_grad()
def thinker_greedy(model: QwenOmni, ids: list[int], max_tokens: int, stop: Sequence[int]) -> list[int]:
    thinker = model.thinker
    out: list[int] = []
    seq = list(ids)
    for _ in range(max_tokens):
        pos = prompt_positions(seq, model.config.thinker.image_token_id)
        hidden = thinker(torch.tensor(seq), pos, DenseAttention())
        token = int(thinker.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        seq.append(token)
        if token in stop:
            break
    return out


@torch.no_grad()
def predict_frame(model: QwenOmni, hidden: torch.Tensor, code0: int) -> list[int]:
    """Greedy codes 1..G-1 of a frame from the Talker's hidden and its code 0 (joined-vocabulary ids)."""
    cp = model.talker.code_predictor
    embeds = torch.stack([hidden, model.talker.embed(torch.tensor(code0))])
    joined: list[int] = []
    for _ in range(cp.heads):
        rows = cp(None, torch.arange(embeds.shape[0]), DenseAttention(), input_embeds=embeds)
        token = int(cp.compute_logits(rows[-1:]).argmax(-1))
        joined.append(token)
        embeds = torch.cat([embeds, cp.embed(torch.tensor([token]))])
    return joined


@torch.no_grad()
def speak_greedy(model: QwenOmni, ids: list[int], speaker: str = "ethan", thinker_max_tokens: int = 16,
                 talker_max_tokens: int = 64, stop: Sequence[int] | None = None
                 ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Text-only prompt -> (reply tokens, codes `[G, frames]`, waveform `[samples]`), greedy on both sides."""
    cfg = model.config
    stop = [cfg.im_end_token_id] if stop is None else list(stop)
    reply = thinker_greedy(model, ids, thinker_max_tokens, stop)
    talker, tc = model.talker, cfg.talker
    feed = TextFeed()
    for token in reply[1:]:
        feed.push(token)
    feed.end()
    pad, eos = (talker.text_projection(model.thinker.embed(torch.tensor(t)))
                for t in (cfg.tts_pad_token_id, cfg.tts_eos_token_id))
    inputs = talker_prompt(model, ids, reply[0], speaker)
    frames: list[list[int]] = []
    codes_v = talker.code_predictor.codebook
    for _ in range(talker_max_tokens):
        hidden = talker(None, torch.arange(inputs.shape[0]), DenseAttention(), input_embeds=inputs)[-1]
        code0 = int(talker.compute_logits(hidden[None]).argmax(-1))
        if code0 == tc.codec_eos_token_id or len(frames) == talker_max_tokens - 1:
            break
        joined = predict_frame(model, hidden, code0)
        frames.append([code0, *(j % codes_v for j in joined)])
        step = talker.embed(torch.tensor(code0)) + talker.code_predictor.embed(torch.tensor(joined)).sum(0)
        text = feed.next()
        step = step + (pad if text == "pad" else eos if text == "eos" else
                       talker.text_projection(model.thinker.embed(torch.tensor(text))))
        inputs = torch.cat([inputs, step[None]])
    codes = torch.tensor(frames, dtype=torch.long).t() if frames else torch.zeros(tc.num_code_groups, 0, dtype=torch.long)
    wav = model.code2wav.chunked_decode(codes[None], 25, 25)[0, 0] if frames else torch.zeros(0)
    return reply, codes, wav
