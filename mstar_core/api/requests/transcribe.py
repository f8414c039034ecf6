"""Speech recognition through a `transcriptions` adapter (Whisper): the one path both audio routes take.

Audio longer than a window is one request: the model's own long-form walk decodes its 30-second windows in turn,
seeking after each one's last timestamp pair (`adapter.long_transcript` reads its segments); it takes no temperature
fallback. Streamed, long audio is cut into whole 30-second windows decoded one after another, each conditioned on
the previous window's text, so the deltas are never taken back. A window decoded at temperature 0 that fails
Whisper's thresholds (compression ratio > 2.4, average log-probability < -1, unless it is silence) is decoded again
at the next temperature of (0.2, 0.4, ..., 1.0); a request that names a temperature above 0 decodes at that one only.
`stream=true` sends the text as it is written (`transcript.text.delta`); a streamed request takes no fallback.
`words=True` (verbose_json only) asks the model for each text token's times and adds the transcript's `words`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.media.resample import resample
from mstar_core.api.requests.submit import cancel_on_exit, sse, stream_error_payload, submit
from mstar_core.api.requests.transcripts import FORMATS, TEMPERATURES, Transcript, srt, verbose_json, vtt


def _windows(samples: np.ndarray, size: int) -> list[np.ndarray]:
    cuts = [samples[i : i + size] for i in range(0, max(len(samples), 1), size)]
    return [c for c in cuts if len(c) >= 400] or [np.pad(samples, (0, 400 - len(samples)))]


async def _decode(state: Any, adapter: Any, model: str, window: np.ndarray, temperature: float, on_token=None,
                  **fields: Any) -> tuple[list[int], list[float], dict[str, Any]]:
    inputs = adapter.transcription_inputs(window, temperature=temperature, **fields)
    handle = await submit(state, model, inputs)
    tokens: list[int] = []
    logprobs: list[float] = []
    async with cancel_on_exit(handle):
        async for out in handle:
            if out.name == "next_token":
                tokens.append(int(out.value))
                if on_token is not None:
                    await on_token(tokens)
            elif out.name == "logprob" and out.value is not None:
                logprobs.append(float(out.value))
        env = await handle.result()
    return tokens, logprobs, env


async def transcribe(request: Request, state: Any, adapter: Any, model: str, samples: np.ndarray, rate: int, *,
                     task: str, language: str | None, prompt: str | None, response_format: str, temperature: float,
                     stream: bool, timestamps: bool, words: bool = False) -> Any:
    if response_format not in FORMATS:
        raise ApiError(400, f"'response_format' {response_format!r} is not served; use one of {', '.join(FORMATS)}",
                       param="response_format")
    if stream and response_format not in ("json", "text"):
        raise ApiError(400, "'stream' gives text deltas; use response_format json or text", param="stream")
    if words and response_format != "verbose_json":
        raise ApiError(400, "word timestamps come in verbose_json: 'timestamp_granularities' with 'word' needs "
                            "response_format verbose_json", param="timestamp_granularities")
    if rate != adapter.sample_rate:
        samples = resample(samples, rate, adapter.sample_rate)
    size = int(adapter.window_seconds * adapter.sample_rate)
    windows = _windows(samples, size)
    timestamps = timestamps or response_format in ("srt", "vtt", "verbose_json")
    temperatures = TEMPERATURES if temperature == 0.0 and not stream else (temperature,)
    if stream:
        return _stream(state, adapter, model, windows, task, language, prompt, temperature, timestamps)
    if len(windows) > 1 and hasattr(adapter, "long_transcript"):
        fields = {"task": task, "language": language, "timestamps": True, "prompt_ids": adapter.prompt_ids(prompt),
                  **_word_fields(words)}
        _, logprobs, env = await _decode(state, adapter, model, samples, temperature, **fields)
        return _respond(adapter.long_transcript(logprobs, env, len(samples) / adapter.sample_rate, temperature),
                        response_format, task)
    parts: list[Transcript] = []
    previous: list[int] = []
    for i, window in enumerate(windows):
        fields = {"task": task, "language": language, "timestamps": timestamps, **_word_fields(words),
                  "prompt_ids": adapter.prompt_ids(prompt if i == 0 else None, previous)}
        for temp in temperatures:
            tokens, logprobs, env = await _decode(state, adapter, model, window, temp, **fields)
            part = adapter.transcript(tokens, logprobs, env, i * adapter.window_seconds, len(window) / adapter.sample_rate,
                                      temp)
            if not part.needs_fallback():
                break
        parts.append(part)
        previous = [] if part.temperature > 0.5 else tokens  # openai-whisper: hot text does not condition the next
    return _respond(_joined(parts, len(samples) / adapter.sample_rate), response_format, task)


def _word_fields(words: bool) -> dict[str, Any]:
    # (only when asked: an adapter without word timestamps need not know the keyword)
    return {"word_timestamps": True} if words else {}


def _respond(transcript: Transcript, response_format: str, task: str) -> Any:
    if response_format == "text":
        return PlainTextResponse(transcript.text)
    if response_format == "srt":
        return PlainTextResponse(srt(transcript.segments))
    if response_format == "vtt":
        return PlainTextResponse(vtt(transcript.segments), media_type="text/vtt")
    if response_format == "verbose_json":
        return OrjsonResponse(verbose_json(transcript, task))
    return OrjsonResponse({"text": transcript.text, "usage": {"type": "duration", "seconds": transcript.duration}})


def _joined(parts: list[Transcript], duration: float) -> Transcript:
    segments, text = [], ""
    for part in parts:
        for s in part.segments:
            segments.append(type(s)(len(segments), *[getattr(s, f) for f in ("start", "end", "text", "tokens",
                                    "avg_logprob", "compression_ratio", "no_speech_prob", "temperature")]))
        text += part.text
    first = parts[0]
    avg = float(np.mean([p.avg_logprob for p in parts]))
    words = None if first.words is None else tuple(w for p in parts for w in p.words or ())
    return Transcript(text.strip(), first.language, duration, tuple(segments), avg, first.no_speech_prob,
                      first.temperature, words)


def _stream(state: Any, adapter: Any, model: str, windows: list[np.ndarray], task: str, language: str | None,
            prompt: str | None, temperature: float, timestamps: bool) -> StreamingResponse:
    async def produce(queue: asyncio.Queue) -> None:
        text, previous = "", []
        try:
            for i, window in enumerate(windows):
                done = text

                async def on_token(tokens: list[int], done: str = done) -> None:
                    nonlocal text
                    now = done + adapter.text(tokens)
                    if len(now) > len(text) and not now.endswith("\ufffd"):  # (a character split across tokens waits)
                        await queue.put(sse({"type": "transcript.text.delta", "delta": now[len(text):]}))
                        text = now

                fields = {"task": task, "language": language, "timestamps": timestamps,
                          "prompt_ids": adapter.prompt_ids(prompt if i == 0 else None, previous)}
                previous, _, _ = await _decode(state, adapter, model, window, temperature, on_token, **fields)
                text = done + adapter.text(previous)
            await queue.put(sse({"type": "transcript.text.done", "text": text.strip()}))
        except Exception as exc:
            await queue.put(sse({"type": "error", **stream_error_payload(exc)}))
        await queue.put(None)

    async def events():
        queue: asyncio.Queue = asyncio.Queue()
        task_ = asyncio.create_task(produce(queue))
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            if not task_.done():
                task_.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
