"""Requests for `qwen3-omni`: chat messages (or prompt ids) in, text out, and speech when a `speaker` is named.

The prompt is Qwen's turn format (`<|im_start|>role\\ncontent<|im_end|>\\n`, then `<|im_start|>assistant\\n`).
Sampling: the Thinker's from the usual fields; the Talker's defaults are the published ones (temperature
0.9, top-k 50, repetition penalty 1.05), the code predictor's top-k 50, top-p 0.8; `talker_temperature: 0`
makes both greedy (as transformers mirrors the Talker's `do_sample` onto the code predictor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams
from mstar_core.schema import RequestField, RequestSchema, sampling_field
from mstar_qwen_omni.config import OmniConfig

SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty")
EXAMPLE = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}


def _text_only(messages: list, name: str) -> list:
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ("system", "user", "assistant"):
            raise RequestError(f"'{name}[{i}]' must be an object with role system, user or assistant", param=name)
        if not isinstance(m.get("content"), str):
            raise RequestError(f"'{name}[{i}].content' must be text here (audio and image parts: not yet)", param=name)
    return messages


class Preparer:
    """`prepare(inputs) -> env`: prompt ids, the Thinker's sampling, and for speech the Talker's and predictor's."""

    def __init__(self, cfg: OmniConfig, tokenizer: Any, with_audio: bool):
        self.cfg, self.tokenizer, self.with_audio = cfg, tokenizer, with_audio
        vocab = cfg.thinker.text.vocab_size
        voices = sorted(cfg.talker.speaker_id) if with_audio else []

        def in_vocab(ids: list[int], name: str) -> list[int]:
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"'{name}' has ids outside the vocabulary [0, {vocab})", param=name)
            return ids

        self.schema = RequestSchema(
            fields=(
                RequestField("messages", "array", "chat messages [{role, content}]", min_length=1, items="object",
                             check=_text_only),
                RequestField("prompt_ids", "array", "a rendered prompt's token ids (ending in the assistant turn)",
                             min_length=1, items="integer", check=in_vocab),
                RequestField("speaker", "string", "speak the reply in this voice (text only when absent)",
                             choices=voices or None),
                RequestField("talker_max_tokens", "integer", "most audio frames (80 ms each), EOS included",
                             default=4096, minimum=1),
                RequestField("talker_temperature", "number", "Talker sampling temperature (0: greedy)", default=0.9,
                             minimum=0),
                RequestField("talker_top_k", "integer", "Talker top-k", default=50, minimum=0),
                RequestField("talker_repetition_penalty", "number", "Talker repetition penalty on code 0",
                             default=1.05, exclusive_minimum=0),
                RequestField("ignore_eos", "boolean", "fixed lengths: the Thinker writes max_tokens tokens and the Talker "
                             "talker_max_tokens frames, past their end tokens (benchmarks)", default=False),
                *(sampling_field(name) for name in SAMPLING),
            ),
            exactly_one_of=(("messages", "prompt_ids"),),
            example=EXAMPLE,
            description="Qwen3-Omni: text in; text out, and speech with `speaker` (streams next_token and audio)",
        )

    def prompt_ids(self, messages: list) -> list[int]:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.tokenizer.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        ids = list(inputs["prompt_ids"]) if inputs.get("prompt_ids") is not None else self.prompt_ids(inputs["messages"])
        fields = {k: inputs[k] for k in SAMPLING if inputs.get(k) is not None}
        ignore_eos = bool(inputs.get("ignore_eos"))
        sampling = SamplingParams(**{"stop_token_ids": () if ignore_eos else (cfg.im_end_token_id,), **fields})
        env: dict[str, Any] = {"prompt_ids": ids, "sampling": sampling.check_vocab(cfg.thinker.text.vocab_size)}
        speaker = inputs.get("speaker")
        if speaker is None:
            return env
        if not self.with_audio:
            raise RequestError("this checkpoint has no Talker (enable_audio_output is false)", param="speaker")
        if inputs["talker_max_tokens"] < 1:
            raise RequestError("'talker_max_tokens' must be at least 1", param="talker_max_tokens")
        greedy = inputs["talker_temperature"] == 0
        tc = cfg.talker
        env.update(
            speaker=speaker.lower(),
            talker_max_tokens=int(inputs["talker_max_tokens"]),
            talker_sampling=SamplingParams(
                temperature=inputs["talker_temperature"], top_k=0 if greedy else inputs["talker_top_k"],
                repetition_penalty=inputs["talker_repetition_penalty"], max_tokens=int(inputs["talker_max_tokens"]),
                stop_token_ids=() if ignore_eos else (tc.codec_eos_token_id,), seed=inputs.get("seed"),
                # ignoring EOS: never sample it (it is no codebook entry Code2Wav could decode)
                logit_bias=((tc.codec_eos_token_id, -100.0),) if ignore_eos else ()),
            predictor_sampling=SamplingParams(
                temperature=0.0 if greedy else 1.0, top_k=0 if greedy else 50, top_p=1.0 if greedy else 0.8,
                max_tokens=1 << 30, seed=inputs.get("seed")),
        )
        return env
