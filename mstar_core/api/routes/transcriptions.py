"""POST /v1/audio/transcriptions: an audio file (multipart) in, its text out.

A model with a `transcriptions` adapter (Whisper) is served by `requests.transcribe`: every response format (json,
text, srt, vtt, verbose_json with segments, and words with their times when `timestamp_granularities` includes
"word", which needs verbose_json), language detection, a text prompt, Whisper's temperature fallback and
streamed text deltas. Otherwise any served model that hears audio in chat (`qwen3-omni`) is asked to transcribe,
greedy unless `temperature` says otherwise, as follows.

`response_format`: `json` (`{text, usage}`), `text` (the bare text), `verbose_json` (`{task, language, duration,
text, usage}`; `language` is the request's, or "unknown": no language detection runs). `stream=true` answers
server-sent events `transcript.text.delta` as the text is written, then `transcript.text.done`. The file is
WAV, FLAC, OGG or MP3 (what libsndfile reads), bounded by the model's chat media limits (bytes and seconds)
before it is decoded. `srt`, `vtt` and word timestamps need timestamps the model does not give: a 400.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import PlainTextResponse, StreamingResponse

from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.media import AudioPart, ChatTurn, MediaLimits, TextPart
from mstar_core.api.media.upload import decode_upload
from mstar_core.api.requests.pipeline import chat_request
from mstar_core.api.requests.schemas import ERROR_RESPONSES
from mstar_core.api.requests.submit import (
    cancel_on_exit,
    first_then_rest,
    sse,
    stream_error_payload,
    submit,
)
from mstar_core.api.requests.text import TextAssembler
from mstar_core.api.requests.transcribe import transcribe
from mstar_core.api.requests.transcription import audio_limits, output_budget
from mstar_core.sampling import check_openai

router = APIRouter()
FORMATS = ("json", "text", "verbose_json")
INSTRUCTION = "Transcribe the audio into text."


@router.post("/v1/audio/transcriptions", responses={200: {"content": {"text/event-stream": {}, "text/plain": {}}},
                                                    **ERROR_RESPONSES},
             summary="Transcribe audio (OpenAI-compatible)")
async def create_transcription(request: Request, file: UploadFile, model: str = Form(...),
                               language: str | None = Form(None), prompt: str | None = Form(None),
                               response_format: str = Form("json"), temperature: float = Form(0.0),
                               stream: bool = Form(False),
                               timestamp_granularities: list[str] | None = Form(None, alias="timestamp_granularities[]")):
    state = request.app.state.mstar
    request.state.model = model
    if (model, "transcriptions") in state.adapters:  # a speech-recognition model (Whisper)
        check_openai("temperature", temperature)
        granularities = set(timestamp_granularities or ())
        if granularities - {"segment", "word"}:
            raise ApiError(400, f"'timestamp_granularities' takes 'segment' and 'word', not "
                                f"{sorted(granularities - {'segment', 'word'})}", param="timestamp_granularities")
        if "word" in granularities and response_format != "verbose_json":  # (OpenAI's rule: words need verbose_json)
            raise ApiError(400, "'timestamp_granularities' with 'word' needs response_format verbose_json",
                           param="timestamp_granularities")
        limits = state.media_limits.get((model, "transcriptions")) or MediaLimits().with_env()
        raw = await file.read(limits.max_audio_bytes + 1)
        samples, rate = await asyncio.to_thread(decode_upload, raw, limits)  # (off the loop, as below)
        return await transcribe(request, state, state.adapter(model, "transcriptions"), model, samples, rate,
                                task="transcribe", language=language, prompt=prompt, response_format=response_format,
                                temperature=temperature, stream=stream, timestamps=bool(timestamp_granularities),
                                words="word" in granularities)
    adapter = state.adapter(model, "chat")
    if "audio" not in (getattr(adapter, "chat_media", ()) or ()):
        raise ApiError(400, f"model '{model}' does not take audio input, so it cannot transcribe", param="model")
    if response_format not in FORMATS:
        raise ApiError(400, f"'response_format' {response_format!r} is not served; use one of {', '.join(FORMATS)} "
                            "(srt and vtt need timestamps this model does not give)", param="response_format")
    if stream and response_format == "verbose_json":
        raise ApiError(400, "'stream' gives text deltas; use response_format json or text", param="stream")
    if "word" in (timestamp_granularities or ()):
        raise ApiError(400, f"model '{model}' gives no timestamps, so no word timestamps; "
                            "'timestamp_granularities' must leave out 'word'", param="timestamp_granularities")
    check_openai("temperature", temperature)  # a RequestError: a 400 naming the field
    if language is not None and (not language.isascii() or not 2 <= len(language) <= 8):
        raise ApiError(400, "'language' must be an ISO-639-1 code such as 'en'", param="language")
    limits = audio_limits(adapter, state.media_limits.get((model, "chat")) or MediaLimits().with_env())
    raw = await file.read(limits.max_audio_bytes + 1)
    samples, rate = await asyncio.to_thread(decode_upload, raw, limits)  # seconds for minutes of FLAC: off the loop
    seconds = samples.size / rate
    instruction = INSTRUCTION + (f" The language is {language}." if language else "")
    if prompt:
        instruction += f" Context: {prompt}"
    turns = [ChatTurn("user", (AudioPart(samples, rate, "file"), TextPart(instruction)))]
    max_tokens = output_budget(seconds)
    body = {"model": model, "messages": [{"role": "user", "content": instruction}], "max_tokens": max_tokens,
            "temperature": temperature}
    inputs = await chat_request(state, adapter, model, body, turns=turns)
    handle = await submit(state, model, inputs)
    text = TextAssembler(adapter, (), max_tokens)

    def usage() -> dict[str, Any]:
        prompt_tokens = adapter.prompt_tokens({}, handle.prepared)
        return {"type": "tokens", "input_tokens": prompt_tokens, "output_tokens": text.generated,
                "total_tokens": prompt_tokens + text.generated}

    def piece(out: Any) -> str:
        if out is None or out.name != adapter.token_output:
            return ""
        return text.feed(int(out.value))

    first, rest = await first_then_rest(request, handle)

    async def pieces():
        yield piece(first)
        if text.finish_reason is None:
            async for out in rest:
                yield piece(out)
                if text.finish_reason is not None:
                    break
        yield text.close({} if text.finish_reason else await handle.result())

    if stream:
        async def events():
            async with cancel_on_exit(handle):
                try:
                    async for delta in pieces():
                        if delta:
                            yield sse({"type": "transcript.text.delta", "delta": delta})
                    yield sse({"type": "transcript.text.done", "text": text.text, "usage": usage()})
                except Exception as exc:
                    yield sse({"type": "error", **stream_error_payload(exc)})

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    async with cancel_on_exit(handle):
        async for _ in pieces():
            pass
    if response_format == "text":
        return PlainTextResponse(text.text)
    if response_format == "verbose_json":
        return OrjsonResponse({"task": "transcribe", "language": language or "unknown", "duration": seconds,
                               "text": text.text, "usage": {"type": "duration", "seconds": seconds}})
    return OrjsonResponse({"text": text.text, "usage": usage()})
