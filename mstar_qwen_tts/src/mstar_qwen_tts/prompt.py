"""The Talker's input rows for a Qwen3-TTS request: the prefill, and the text rows its decode steps add.

Text is wrapped as `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n` (role: ids [0:3], text:
[3:-5]); a voice description or style hint as a `<|im_start|>user\\n{instruct}<|im_end|>\\n` turn, projected and
placed first. The codec side of the prefix is [think, think_bos, language, think_eos] ([nothink, think_bos,
think_eos] for "auto"), then the speaker's slot (a preset speaker's codec embedding, a cloned voice's x-vector;
none for voice design), then
[pad, bos]; its text side is `tts_pad` but `tts_bos` on the position before bos.

- streaming text: the last prefill row is proj(first text token) + codec bos; decode step k adds text token k + 1,
  then `tts_eos`, then `tts_pad`.
- non-streaming (the upstream default for preset speakers and voice design): every text token + `tts_eos` over
  codec pad, then `tts_pad` + codec bos; every decode step adds `tts_pad`.

A cloned voice with its transcript (Base, in-context: the upstream default when the voice has `ref_text`) replaces
both with one block after the prefix, whose text side is the reference text's tokens (its turn's [3:-2]), then the
target text's, then `tts_eos`, and whose codec side is codec bos, then each reference frame's summed G embeddings
(the voice's `ref_codes`):
- streaming: the two sides added position by position; text beyond the codec side is fed one row per step, then
  `tts_pad` (a shorter text side is padded with `tts_pad`);
- non-streaming: the text side over codec pad, then the codec side over `tts_pad`; every step adds `tts_pad`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar_qwen_tts.config import TTSConfig
from mstar_qwen_tts.talker import Talker


def language_id(cfg: TTSConfig, language: str, speaker: str) -> int | None:
    """The codec language id (None: "auto"); a dialect speaker's own id replaces Chinese and "auto"."""
    tc = cfg.talker
    lang = language.lower()
    out = None if lang == "auto" else tc.codec_language_id[lang]
    dialect = tc.spk_is_dialect.get(speaker, False) if speaker else False
    if lang in ("chinese", "auto") and dialect is not False:
        out = tc.codec_language_id[dialect]
    return out


@torch.no_grad()
def talker_rows(talker: Talker, cfg: TTSConfig, text_ids: Sequence[int], instruct_ids: Sequence[int],
                speaker: str, language: str, non_streaming: bool,
                speaker_embedding: torch.Tensor | None = None, ref_ids: Sequence[int] | None = None,
                ref_codes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill rows `[P, H]`, text rows of decode steps `[N, H]` whose last row, `tts_pad`, repeats forever).

    `speaker_embedding` `[H]`: a cloned voice's x-vector, which fills the speaker slot in place of a preset speaker;
    `ref_ids` (the reference transcript's tokens) with `ref_codes` `[T, G]`: the in-context clone prompt.
    """
    tc = cfg.talker
    device = talker.codec_head.weight.device

    def ids(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    bos, eos, pad = talker.text_rows(ids([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]))
    lang = language_id(cfg, language, speaker)
    tags = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if lang is None
            else [tc.codec_think_id, tc.codec_think_bos_id, lang, tc.codec_think_eos_id])
    codec = [talker.embed(ids(tags))]
    if speaker_embedding is not None:
        codec.append(speaker_embedding.to(device=device, dtype=codec[0].dtype).view(1, -1))
    elif speaker:
        codec.append(talker.embed(ids([tc.spk_id[speaker]])))
    codec.append(talker.embed(ids([tc.codec_pad_id, tc.codec_bos_id])))
    codec_rows = torch.cat(codec)
    text_side = torch.cat([pad[None].expand(codec_rows.shape[0] - 2, -1), bos[None]])
    rows = [talker.text_rows(ids(instruct_ids))] if instruct_ids else []
    rows += [talker.text_rows(ids(text_ids[:3])), text_side + codec_rows[:-1]]
    body = list(text_ids[3:-5])
    if ref_codes is not None:
        block, trailing = _in_context(talker, cfg, ids([*(ref_ids or ()), *body]), ref_codes.to(device), non_streaming,
                                      eos, pad)
        return torch.cat([*(r.view(-1, r.shape[-1]) for r in rows), block]), trailing
    if non_streaming:
        spoken = torch.cat([talker.text_rows(ids(body)), eos[None]])
        rows += [spoken + talker.embed(ids([tc.codec_pad_id] * spoken.shape[0])),
                 (pad + talker.embed(ids([tc.codec_bos_id])))]
        trailing = pad[None]
    else:
        rows.append(talker.text_rows(ids(body[:1])) + codec_rows[-1:])
        trailing = torch.cat([talker.text_rows(ids(body[1:])), eos[None], pad[None]])
    return torch.cat([r.view(-1, r.shape[-1]) for r in rows]), trailing


def _in_context(talker: Talker, cfg: TTSConfig, text: torch.Tensor, ref_codes: torch.Tensor, non_streaming: bool,
                eos: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-context block after the prefix and the decode steps' text rows (see the module docstring)."""
    tc = cfg.talker
    text_side = torch.cat([talker.text_rows(text), eos[None]])
    # each reference frame's G embeddings stacked, then summed over G (as upstream sums them: the same order)
    frame = torch.stack([talker.embed(ref_codes[:, 0]),
                         *(table(ref_codes[:, g + 1]) for g, table in enumerate(talker.code_predictor.model.codec_embedding))],
                        dim=1).sum(1)
    bos = talker.embed(torch.tensor([tc.codec_bos_id], device=frame.device))
    codec_side = torch.cat([bos, frame])
    if non_streaming:
        over_pad = talker.embed(torch.full((text_side.shape[0],), tc.codec_pad_id, device=frame.device))
        return torch.cat([text_side + over_pad, codec_side + pad[None]]), pad[None]
    n = codec_side.shape[0]
    if text_side.shape[0] > n:
        return text_side[:n] + codec_side, torch.cat([text_side[n:], pad[None]])
    padded = torch.cat([text_side, pad[None].expand(n - text_side.shape[0], -1)])
    return padded + codec_side, pad[None]
