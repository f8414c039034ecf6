"""Requests for `qwen3-tts`: text (and a preset speaker or a voice description) in, speech out.

Sampling defaults are the checkpoint's `generation_config.json` (the published: Talker top-k 50, top-p 1.0,
temperature 0.9, repetition penalty 1.05; the code predictor the same without the penalty); `do_sample: false` and
`subtalker_dosample: false` make either greedy. As upstream (`min_new_tokens` 2), the first two code-0 samples are
never EOS: they use `talker_opening_sampling`, the same with EOS biased out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams
from mstar_core.schema import RequestField, RequestSchema

EXAMPLE = {"input": "Hello there!", "max_frames": 16}

#: The published `generation_config.json` values (a checkpoint's own file overrides them).
GENERATION_DEFAULTS = {"do_sample": True, "top_k": 50, "top_p": 1.0, "temperature": 0.9,
                       "repetition_penalty": 1.05, "subtalker_dosample": True, "subtalker_top_k": 50,
                       "subtalker_top_p": 1.0, "subtalker_temperature": 0.9, "max_new_tokens": 2048}


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def reference_text(text: str) -> str:
    """A cloned voice's transcript, wrapped as upstream's `ref_text` (its tokens [3:-2] are the text)."""
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


class Preparer:
    """`prepare(inputs) -> env`: the wrapped text ids, instruct ids, speaker, language and both samplings."""

    def __init__(self, cfg: Any, tokenizer: Any, generation: Mapping[str, Any] | None = None):
        self.cfg, self.tokenizer = cfg, tokenizer
        gen = {**GENERATION_DEFAULTS, **{k: v for k, v in (generation or {}).items() if k in GENERATION_DEFAULTS}}
        tc = cfg.talker
        self.speakers = sorted(tc.spk_id)
        self.languages = ["auto", *sorted(k for k in tc.codec_language_id if "dialect" not in k)]
        kind = cfg.tts_model_type
        voice_help = {"custom_voice": "a preset speaker", "voice_design": "none: describe the voice in `instructions`",
                      "base": "a voice created with POST /v1/audio/voices"}[kind]
        self.schema = RequestSchema(
            fields=(
                RequestField("input", "string", "the text to speak", required=True, min_length=1, blank=False),
                RequestField("voice", "string", f"the voice: {voice_help}",
                             default=self.speakers[0] if kind == "custom_voice" and self.speakers else None,
                             choices=self.speakers or None),
                RequestField("instructions", "string", "voice design: a description of the voice; a preset speaker: "
                             "a style hint (the 0.6B checkpoints ignore it)", min_length=1),
                RequestField("language", "string", "the language spoken (auto: the model guesses)", default="auto",
                             choices=self.languages),
                RequestField("non_streaming_mode", "boolean", "feed the whole text before the first frame (the "
                             "upstream default for preset speakers and voice design) or one token per frame (its "
                             "default for cloned voices)", default=kind != "base"),
                RequestField("max_frames", "integer", "most code-0 samples (80 ms frames), EOS included",
                             default=int(gen["max_new_tokens"]), minimum=1, maximum=8192),
                RequestField("do_sample", "boolean", "sample the Talker's code 0 (false: greedy)",
                             default=bool(gen["do_sample"])),
                RequestField("temperature", "number", "Talker temperature", default=float(gen["temperature"]),
                             minimum=0),
                RequestField("top_k", "integer", "Talker top-k", default=int(gen["top_k"]), minimum=0),
                RequestField("top_p", "number", "Talker top-p", default=float(gen["top_p"]), minimum=0, maximum=1),
                RequestField("repetition_penalty", "number", "Talker repetition penalty on code 0",
                             default=float(gen["repetition_penalty"]), exclusive_minimum=True, minimum=0),
                RequestField("subtalker_dosample", "boolean", "sample codes 1..15 (false: greedy)",
                             default=bool(gen["subtalker_dosample"])),
                RequestField("subtalker_temperature", "number", "code predictor temperature",
                             default=float(gen["subtalker_temperature"]), minimum=0),
                RequestField("subtalker_top_k", "integer", "code predictor top-k", default=int(gen["subtalker_top_k"]),
                             minimum=0),
                RequestField("subtalker_top_p", "number", "code predictor top-p",
                             default=float(gen["subtalker_top_p"]), minimum=0, maximum=1),
                RequestField("speaker_embedding", "array", "Base checkpoints: a cloned voice's x-vector "
                             f"({cfg.talker.text.hidden_size} numbers, what the voices route computed)",
                             items="number", min_length=cfg.talker.text.hidden_size,
                             max_length=cfg.talker.text.hidden_size),
                RequestField("ref_text", "string", "Base checkpoints: a cloned voice's transcript, for the in-context "
                             "clone prompt (with 'ref_codes')", min_length=1, blank=False),
                RequestField("ref_codes", "array", "Base checkpoints: the reference audio's codes (what the voices "
                             f"route computed), frame by frame: {cfg.talker.num_code_groups} codes a frame, each below "
                             f"{cfg.talker.predictor.vocab_size}", items="integer",
                             min_length=cfg.talker.num_code_groups, check=self._check_ref_codes),
                RequestField("seed", "integer", "sampling seed", minimum=0),
                RequestField("ignore_eos", "boolean", "speak exactly max_frames frames (benchmarks)", default=False),
            ),
            example=EXAMPLE,
            description="Qwen3-TTS: text in, 24 kHz speech out (streams codes and audio)",
        )

    def _check_ref_codes(self, value: Any, name: str) -> Any:
        groups, size = self.cfg.talker.num_code_groups, self.cfg.talker.predictor.vocab_size
        if len(value) % groups:
            raise RequestError(f"'{name}' holds {len(value)} codes: a whole number of frames of {groups} codes",
                               param=name)
        if any(not 0 <= int(c) < size for c in value):
            raise RequestError(f"'{name}': every code must be in [0, {size})", param=name)
        return value

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _voice(self, inputs: Mapping[str, Any]) -> tuple[str, list[int]]:
        cfg, kind = self.cfg, self.cfg.tts_model_type
        voice, instruct = inputs.get("voice"), inputs.get("instructions")
        if kind == "base":
            if inputs.get("speaker_embedding") is None:
                raise RequestError("a Base checkpoint speaks cloned voices only: send 'speaker_embedding' (a voice "
                                   "created with POST /v1/audio/voices, named by 'voice' on the speech route)",
                                   param="voice")
            return "", []  # (the upstream clone path has no instruct turn)
        if kind == "voice_design":
            if voice:
                raise RequestError("a VoiceDesign checkpoint has no preset speakers: describe the voice in "
                                   "'instructions' and leave 'voice' out", param="voice")
            if not instruct:
                raise RequestError("a VoiceDesign checkpoint needs 'instructions': a description of the voice",
                                   param="instructions")
        elif not voice:
            raise RequestError(f"'voice' must name a speaker: one of {self.speakers}", param="voice")
        ids = self._ids(instruct_text(instruct)) if instruct and cfg.keeps_instruct else []
        return (str(voice).lower() if voice else ""), ids

    def _clone(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """A cloned voice's x-vector and, with its transcript, the in-context prompt: tokens and codes `[T, G]`."""
        clone: dict[str, Any] = {}
        if speaker_embedding := inputs.get("speaker_embedding"):
            if self.cfg.tts_model_type != "base":
                raise RequestError("'speaker_embedding' (a cloned voice) needs a Base checkpoint", param="voice")
            clone["speaker_embedding"] = torch.tensor([float(v) for v in speaker_embedding])
        ref_text, ref_codes = inputs.get("ref_text"), inputs.get("ref_codes")
        if (ref_text is None) != (ref_codes is None):
            missing = "ref_codes" if ref_codes is None else "ref_text"
            raise RequestError("the in-context clone prompt needs both 'ref_text' and 'ref_codes'", param=missing)
        if ref_codes is not None:
            if not clone:
                raise RequestError("'ref_codes' belong to a cloned voice: send its 'speaker_embedding' too",
                                   param="speaker_embedding")
            clone["ref_ids"] = self._ids(reference_text(ref_text))[3:-2]
            clone["ref_codes"] = torch.tensor([int(c) for c in ref_codes]).view(-1, self.cfg.talker.num_code_groups)
        return clone

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        speaker, instruct_ids = self._voice(inputs)
        text_ids = self._ids(assistant_text(inputs["input"]))
        if len(text_ids) < 9:  # role (3) + at least one text token + the closing turn and next role (5)
            raise RequestError("'input' has no text to speak", param="input")
        limit = self.cfg.talker.text.max_position_embeddings
        frames = int(inputs["max_frames"])
        clone = self._clone(inputs)
        reference = len(clone.get("ref_ids", ())) + len(clone.get("ref_codes", ()))
        if len(text_ids) + len(instruct_ids) + reference + frames + 16 > limit:
            raise RequestError(f"the text and max_frames need more than this Talker's {limit} positions: send shorter "
                               f"text or fewer frames", status=413, param="input")
        tc = self.cfg.talker
        ignore_eos = bool(inputs.get("ignore_eos"))
        greedy = not inputs["do_sample"] or inputs["temperature"] == 0
        sub_greedy = not inputs["subtalker_dosample"] or inputs["subtalker_temperature"] == 0
        seed = inputs.get("seed")
        talker = SamplingParams(
            temperature=0.0 if greedy else inputs["temperature"], top_k=0 if greedy else inputs["top_k"],
            top_p=1.0 if greedy else inputs["top_p"], repetition_penalty=inputs["repetition_penalty"],
            max_tokens=frames, seed=seed, stop_token_ids=() if ignore_eos else (tc.codec_eos_token_id,),
            # ignoring EOS: never sample it (it is no codebook entry the decoder could decode)
            logit_bias=((tc.codec_eos_token_id, -100.0),) if ignore_eos else ())
        return {**clone,
            "text_ids": text_ids, "instruct_ids": instruct_ids, "speaker": speaker, "language": inputs["language"],
            "non_streaming": bool(inputs["non_streaming_mode"]), "talker_max_tokens": frames,
            "talker_sampling": talker,
            "talker_opening_sampling": attrs.evolve(talker, logit_bias=((tc.codec_eos_token_id, -100.0),)),
            "predictor_sampling": SamplingParams(
                temperature=0.0 if sub_greedy else inputs["subtalker_temperature"],
                top_k=0 if sub_greedy else inputs["subtalker_top_k"],
                top_p=1.0 if sub_greedy else inputs["subtalker_top_p"], max_tokens=1 << 30, seed=seed),
        }
