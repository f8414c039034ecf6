"""The `/v1/audio/transcriptions` and `/v1/audio/translations` adapter: an upload's 16 kHz samples -> Whisper's request
fields, and Whisper's tokens (timestamps, log-probabilities, P(no speech), per-token times) -> a `Transcript`.

Times never pass the audio's end: a window's timestamp tokens may name any time in its 30 seconds (a random or
confused model writes <|29.98|> over a 3-second clip), so segments and words are clamped to the audio's duration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mstar_core.api.requests.adapters import ApiAdapter
from mstar_core.api.requests.transcripts import Segment, TimedWord, Transcript, compression_ratio
from mstar_core.errors import RequestError
from mstar_whisper.words import timed_words

#: the previous text a prompt may carry (Whisper keeps half of its 448 positions for it)
MAX_PROMPT_TOKENS = 223


class WhisperAudioAdapter(ApiAdapter):
    model = "whisper"
    routes = {"transcriptions"}
    sample_rate = 16000
    token_output = "next_token"
    window_seconds = 30.0

    def bind(self, loaded: Any) -> None:
        super().bind(loaded)
        self.tokenizer, self.tokens = loaded.extras["tokenizer"], loaded.extras["tokens"]
        self.sample_rate = int(loaded.extras.get("sample_rate", 16000))
        self.code_of = {v: k for k, v in self.tokens.languages.items()}

    def prompt_ids(self, prompt: str | None, previous: Sequence[int] = ()) -> list[int]:
        """Text to condition on: the request's prompt, then the previous window's text tokens (the latest kept)."""
        ids = list(self.tokenizer.encode(" " + prompt.strip()).ids) if prompt and prompt.strip() else []
        ids += [t for t in previous if t < self.tokens.eot]
        return ids[-MAX_PROMPT_TOKENS:]

    def transcription_inputs(self, samples: np.ndarray, *, task: str, language: str | None, prompt_ids: list[int],
                             temperature: float, timestamps: bool, word_timestamps: bool = False,
                             max_tokens: int | None = None) -> dict[str, Any]:
        if language is not None and self.tokens.language_id(language) is None:
            known = ", ".join(sorted(self.tokens.languages)[:12])
            raise RequestError(f"'language' {language!r} is not one this model knows ({known}, ...)", param="language")
        inputs: dict[str, Any] = {"audio": torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)),
                                  "task": task, "timestamps": timestamps, "prompt_ids": prompt_ids,
                                  "temperature": temperature, "word_timestamps": word_timestamps}
        if language is not None:
            inputs["language"] = language.strip().lower()
        if max_tokens is not None:
            inputs["max_tokens"] = max_tokens
        return inputs

    def text(self, tokens: Sequence[int]) -> str:
        """The words of `tokens` (special and timestamp tokens left out)."""
        return self.tokenizer.decode([t for t in tokens if t < self.tokens.eot])

    def _words(self, per_window: Sequence[tuple[Sequence[tuple[int, float, float]], float, float]],
               language: str) -> tuple[TimedWord, ...]:
        """Each window's `(token, start, end)` (window-relative), offset and limit -> the transcript's words."""
        decode = self.tokenizer.decode
        return tuple(TimedWord(w.word.strip(), w.start, w.end) for times, offset, limit in per_window
                     for w in timed_words(times, decode, offset, limit, language))

    def transcript(self, tokens: Sequence[int], logprobs: Sequence[float], env: dict[str, Any], offset: float,
                   duration: float, temperature: float) -> Transcript:
        """One window's tokens as segments (split at timestamp pairs; the whole window when it has none), and its
        words when the request asked (`env["token_times"]`)."""
        t = self.tokens
        avg = float(np.mean(logprobs)) if logprobs else 0.0
        no_speech = env.get("no_speech")
        no_speech = float(no_speech[0]) if isinstance(no_speech, torch.Tensor) else 0.0
        language = env.get("detected_language") if env.get("language_token", -1) < 0 else env.get("language_token")
        text = self.text(tokens)
        ratio = compression_ratio(text)
        pieces: list[tuple[float, float, list[int]]] = []
        start, words = None, []
        end = offset + duration
        for tok in tokens:
            if tok >= t.timestamp_begin:
                time = min(offset + (tok - t.timestamp_begin) * 0.02, end)
                if start is None:
                    start = time
                else:
                    pieces.append((start, time, words))
                    start, words = None, []
            elif tok < t.eot:
                words.append(tok)
        if words or not pieces:  # text after the last pair (or no timestamps at all): until the window's end
            first = offset if start is None else start
            pieces.append((first, max(first, end), words))
        segments = tuple(Segment(i, a, b, self.text(w), tuple(w), avg, ratio, no_speech, temperature)
                         for i, (a, b, w) in enumerate(pieces) if w or len(pieces) == 1)
        code = self.code_of.get(language, "unknown")
        timed = self._words([(env["token_times"], offset, end)], code) if "token_times" in env else None
        return Transcript(text, code, duration, segments, avg, no_speech, temperature, timed)

    def long_transcript(self, logprobs: Sequence[float], env: dict[str, Any], duration: float,
                        temperature: float) -> Transcript:
        """A long-form request's segments, as its walk split each window (`env["windows"]`), and its words when
        asked (`env["window_token_times"]`, each window's offset by its seek)."""
        avg = float(np.mean(logprobs)) if logprobs else 0.0
        no_speech = env.get("no_speech")
        no_speech = float(no_speech[0]) if isinstance(no_speech, torch.Tensor) else 0.0
        language = env.get("detected_language") if env.get("language_token", -1) < 0 else env.get("language_token")
        parts = [(min(a, duration), min(b, duration), [t for t in toks if t < self.tokens.eot])
                 for w in env["windows"] for a, b, toks in w["segments"]]
        text = "".join(self.text(t) for _, _, t in parts)
        ratio = compression_ratio(text)
        segments = tuple(Segment(i, a, b, self.text(t), tuple(t), avg, ratio, no_speech, temperature)
                         for i, (a, b, t) in enumerate(parts))
        code = self.code_of.get(language, "unknown")
        words = None
        if env.get("word_timestamps"):
            # a window's words end where the next window starts (its seek: after the kept segments' last timestamp),
            # so the words stay in order even where the alignment runs a kept word into the window's tail
            windows = env["windows"]
            limits = [min(w["offset"], duration) for w in windows[1:]] + [duration]
            per_window = [(times, w["offset"], limit)
                          for times, w, limit in zip(env["window_token_times"], windows, limits, strict=True)]
            words = self._words(per_window, code)
        return Transcript(text, code, duration, segments, avg, no_speech, temperature, words)
