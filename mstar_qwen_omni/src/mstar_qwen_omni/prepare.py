"""Requests for `qwen3-omni`: chat messages (or prompt ids) in, text out, and speech when a `speaker` is named.

The prompt is Qwen's turn format (`<|im_start|>role\\ncontent<|im_end|>\\n`, then `<|im_start|>assistant\\n`).
Sampling: the Thinker's from the usual fields; the Talker's defaults are the published ones (temperature
0.9, top-k 50, repetition penalty 1.05), the code predictor's top-k 50, top-p 0.8; `talker_temperature: 0`
makes both greedy (as transformers mirrors the Talker's `do_sample` onto the code predictor).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingDefaults, SamplingParams, sampling_names
from mstar_core.schema import RequestField, RequestSchema, sampling_field
from mstar_qwen_omni.config import OmniConfig

SAMPLING = sampling_names("max_tokens", "temperature", "top_k", "top_p", "seed", "repetition_penalty", "grammar")
EXAMPLE = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}


class Preparer:
    """`prepare(inputs) -> env`: prompt ids, the Thinker's sampling, and for speech the Talker's and predictor's."""

    def __init__(self, cfg: OmniConfig, tokenizer: Any, with_audio: bool, patcher: Any = None,
                 sampling_defaults: SamplingDefaults | None = None):
        # imported here, not at the top: `model` imports this module for its EXAMPLE at discovery, and the prompt
        # builder brings PIL and the image and audio feature code, which only a loaded model needs
        from mstar_qwen_omni.prompt import PromptBuilder

        self.cfg, self.tokenizer, self.with_audio = cfg, tokenizer, with_audio
        #: the Thinker's defaults for sampling fields a request leaves unset (the checkpoint's generation_config)
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.build = PromptBuilder(cfg, tokenizer, patcher)
        vocab = cfg.thinker.text.vocab_size
        voices = sorted(cfg.talker.speaker_id) if with_audio else []

        def in_vocab(ids: list[int], name: str) -> list[int]:
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"'{name}' has ids outside the vocabulary [0, {vocab})", param=name)
            return ids

        self.schema = RequestSchema(
            fields=(
                RequestField("messages", "array", "chat messages [{role, content}]; content is text or a list of "
                             "parts {type: text, text} | {type: audio, audio: 16 kHz samples} | "
                             "{type: image, image: [H, W, 3] uint8} | {type: video, video: [F, H, W, 3] uint8, fps}",
                             min_length=1, items="object"),
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

    def _prompt(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if inputs.get("prompt_ids") is not None:
            ids = list(inputs["prompt_ids"])
            t = self.cfg.thinker
            if any(i in (t.image_token_id, t.audio_token_id, t.video_token_id) for i in ids):
                raise RequestError("'prompt_ids' cannot hold media placeholders: send media as message parts",
                                   param="prompt_ids")
            return {"prompt_ids": ids}
        prompt = self.build(inputs["messages"])
        env: dict[str, Any] = {"prompt_ids": prompt.ids}
        if prompt.has_media:
            env.update(has_media=True, prompt_positions=prompt.positions)
            if prompt.audio:
                env["audio_features"] = prompt.audio
            if prompt.patches:
                env["image_patches"] = torch.cat(prompt.patches)
                env["image_grid"] = torch.tensor(prompt.grids)
            if prompt.video_patches:
                env["video_patches"] = torch.cat(prompt.video_patches)
                env["video_grid"] = torch.tensor(prompt.video_grids)
        return env

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        env = self._prompt(inputs)
        limit = cfg.thinker.text.max_position_embeddings
        if len(env["prompt_ids"]) + 1 > limit:  # refused here, before any engine work, not when the prefill overflows
            key = "prompt_ids" if inputs.get("prompt_ids") is not None else "messages"
            raise RequestError(f"the prompt is {len(env['prompt_ids'])} tokens (media included); this model's context "
                               f"holds {limit}: send shorter text, audio or images", status=413, param=key)
        fields = self.sampling_defaults.merged({k: inputs[k] for k in SAMPLING if inputs.get(k) is not None})
        ignore_eos = bool(inputs.get("ignore_eos"))
        sampling = SamplingParams(**{"stop_token_ids": () if ignore_eos else (cfg.im_end_token_id,), **fields})
        env["sampling"] = sampling.check_vocab(cfg.thinker.text.vocab_size)
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
