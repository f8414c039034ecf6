"""The Orpheus prompt format, voices, special token ids and per-request inputs."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.sampling import SamplingParams, sampling_names
from mstar_core.schema import RequestField, RequestSchema, sampling_fields
from mstar_orpheus.codes import AudioTokenMap

VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
EMOTION_TAGS = ("<laugh>", "<chuckle>", "<sigh>", "<cough>", "<sniffle>", "<groan>", "<yawn>", "<gasp>")
DEFAULT_SAMPLING = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3}
DEFAULT_MAX_TOKENS = 1200  # the orpheus-speech package's default
_SAMPLING_FIELDS = sampling_names("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
EXAMPLE = {"text": "Hello there!", "voice": "tara", "max_tokens": 28}


def request_schema(voices: tuple[str, ...] = VOICES, max_tokens_limit: int = 4096) -> RequestSchema:
    """Orpheus' request fields: the text, a voice, how many audio tokens, and sampling."""
    return RequestSchema(
        fields=(
            RequestField("text", "string", "the text to speak; emotion tags such as <laugh> are read as such",
                         required=True, blank=False),
            RequestField("voice", "string", "the speaker", default=voices[0], choices=voices),
            RequestField("max_tokens", "integer", "the most audio tokens to generate (7 per 85 ms frame)",
                         default=DEFAULT_MAX_TOKENS, minimum=1, maximum=max_tokens_limit),
            *sampling_fields(*_SAMPLING_FIELDS, defaults=DEFAULT_SAMPLING),
            RequestField("ignore_eos", "boolean", "speak exactly max_tokens audio tokens (benchmarks)", default=False),
        ),
        example=EXAMPLE,
        description="text to speech: streams 24 kHz audio (`audio`) as the LM writes SNAC codes",
    )


@attrs.frozen
class OrpheusVocab:
    """Token ids the prompt and the stop rule use; special tokens sit right above the audio base."""

    audio: AudioTokenMap
    end_of_text: int = 128009  # <|eot_id|>

    @property
    def start_of_speech(self) -> int:
        """`<custom_token_1>` (128257): the prompt's last id; audio tokens follow it."""
        return self.audio.base + 1

    @property
    def end_of_speech(self) -> int:
        """`<custom_token_2>` (128258): generation stops here."""
        return self.audio.base + 2

    @property
    def start_of_human(self) -> int:
        """`<custom_token_3>` (128259): opens the prompt."""
        return self.audio.base + 3

    @property
    def end_of_human(self) -> int:
        """`<custom_token_4>` (128260): closes the user turn."""
        return self.audio.base + 4

    @property
    def start_of_ai(self) -> int:
        """`<custom_token_5>` (128261): opens the model turn."""
        return self.audio.base + 5

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, codebook_size: int) -> OrpheusVocab:
        """Read `<custom_token_0>` and `<|eot_id|>` from the tokenizer, falling back to Orpheus' ids."""
        base = tokenizer.token_to_id("<custom_token_0>")
        eot = tokenizer.token_to_id("<|eot_id|>")
        return cls(
            AudioTokenMap(base=128256 if base is None else base, codebook_size=codebook_size),
            end_of_text=128009 if eot is None else eot,
        )


@attrs.define
class PromptBuilder:
    """`prepare(inputs)`: raw request inputs -> the env of the `prefill` walk.

    Inputs (checked by `request_schema` first): `text`, `voice` (one of VOICES), `max_tokens`, sampling fields.
    The prompt is `[start_of_human] + tok("{voice}: {text}") + [eot, end_of_human, start_of_ai,
    start_of_speech]`; prefill takes all but the last id, so that `decode` feeds start_of_speech
    and every generated token (the first included) comes out of the decode walk's stream.
    """

    tokenizer: Any
    vocab: OrpheusVocab
    voices: tuple[str, ...] = VOICES
    max_tokens_limit: int = 4096
    #: The LM's vocabulary size, which bounds `top_k` (None: the audio tokens' end, the least it can be).
    vocab_size: int | None = None

    def prompt_ids(self, text: str, voice: str) -> list[int]:
        """The full prompt token ids for one utterance."""
        v = self.vocab
        body = self.tokenizer.encode(f"{voice}: {text}").ids
        return [v.start_of_human, *body, v.end_of_text, v.end_of_human, v.start_of_ai, v.start_of_speech]

    @property
    def schema(self) -> RequestSchema:
        return request_schema(self.voices, self.max_tokens_limit)

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Inputs already checked by `schema` (defaults filled in)."""
        text, voice, max_tokens = inputs["text"], inputs["voice"], inputs["max_tokens"]
        fields = {k: inputs[k] for k in _SAMPLING_FIELDS if inputs.get(k) is not None}
        # +1: the engine also counts prefill's sample, which decode discards (see the docstring)
        end = self.vocab.end_of_speech
        # ignoring the end: never sample end-of-speech (a model's own end would cut the benchmark's utterance short)
        ending = ({"stop_token_ids": (), "logit_bias": {str(end): -100.0}} if inputs.get("ignore_eos")
                  else {"stop_token_ids": (end,)})
        sampling = SamplingParams.from_mapping(
            {**fields, "max_tokens": max_tokens + 1, **ending}
        ).check_vocab(self.vocab_size or self.vocab.audio.end)
        ids = self.prompt_ids(text, voice)
        return {
            "prompt_ids": ids[:-1],
            "decode_ids": ids[-1:],
            "sampling": sampling,
            "max_tokens": max_tokens,
            # without a seed the codec noise is random per request, as in the reference decoder
            "noise_seed": random.randrange(2**31) if sampling.seed is None else sampling.seed,
        }
