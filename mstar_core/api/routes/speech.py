"""POST /v1/audio/speech: text in, audio streamed out as the model produces it (wav, pcm, flac, mp3, opus, aac or SSE)."""

from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from mstar_core.api.http.bodies import CutOnErrorStreamingResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.media.audio import MEDIA_TYPES, AudioEncoder
from mstar_core.api.requests.adapters import api_named
from mstar_core.api.requests.schemas import ERROR_RESPONSES, SpeechRequest
from mstar_core.api.requests.submit import (
    adapter_call,
    cancel_on_exit,
    held_until,
    sse,
    stream_error_payload,
    submit,
)
from mstar_core.api.requests.voices import caller_scope, is_voice_id
from mstar_core.sampling import check_fields

router = json_router()  # large JSON bodies parsed off the event loop

@router.post(
    "/v1/audio/speech",
    responses={
        200: {"content": {**{t: {} for t in MEDIA_TYPES.values()}, "text/event-stream": {}},
              "description": "audio bytes as produced (every format streams), or SSE `speech.audio.delta` / "
                             "`speech.audio.done` events"},
        **ERROR_RESPONSES,
    },
    response_class=Response,
    summary="Text to speech (OpenAI-compatible)",
)
async def create_speech(body: SpeechRequest, request: Request) -> Response:
    state = request.app.state.mstar
    request.state.model = body.model
    adapter = state.adapter(body.model, "speech")
    payload = body.model_dump()
    if is_voice_id(payload.get("voice")):  # a cloned voice: this key's own, its prompt computed when it was created
        voice = state.voices.get(caller_scope(request.headers), payload["voice"], param="voice")
        if voice.model != body.model:
            raise ApiError(400, f"voice '{voice.id}' was created for model '{voice.model}', not '{body.model}'",
                           param="voice")
        payload["voice"], payload["cloned_voice"] = None, dict(voice.prompt)
    # voice, speed and their bounds are the model's declared fields: its schema checks them when the request is
    # prepared; the route only fills the model's default voice and refuses a field the model does not take
    if payload.get("voice") is None and "cloned_voice" not in payload:
        payload["voice"] = adapter.field_default("speech", "voice") or (adapter.voices[0] if adapter.voices else None)
    voice_field = adapter.model_field("speech", "voice")
    if voice_field is None and adapter.voices and payload["voice"] not in (*adapter.voices, None):  # no schema: the adapter's list
        raise ApiError(400, f"voice '{payload['voice']}' is not available for model '{body.model}'; "
                            f"choose one of: {', '.join(adapter.voices)}", param="voice")
    if body.speed != 1.0 and adapter.model_field("speech", "speed") is None and not adapter.supports_speed:
        raise ApiError(400, f"model '{body.model}' only speaks at speed 1.0 (it declares no 'speed'); drop 'speed'",
                       param="speed")
    if body.speed == 1.0:
        payload.pop("speed", None)
    check_fields(payload)  # sampling extras (seed, temperature, max_tokens, ...) mean the same for every model
    inputs = adapter_call(adapter.speech_inputs, payload, what=f"the speech adapter of '{body.model}'")
    started = time.perf_counter()
    try:
        handle = await submit(state, body.model, inputs)
    except ApiError as exc:
        raise api_named(exc, adapter, "speech") from None
    streaming = (payload.get("stream") is not False) or body.stream_format == "sse"
    # FLAC streamed has no length in its header (see audio.py): only when asked for explicitly
    encode_streaming = streaming and (body.response_format != "flac" or payload.get("stream") is True)
    encoder = AudioEncoder(body.response_format, int(adapter.sample_rate), stream=encode_streaming)
    # the status line waits for the first audio: a request whose codec fails before it (its worker lost and
    # being replaced) is then a 503 with Retry-After, not a 200 whose body is cut off after the LM's tokens
    held, rest = await held_until(request, handle, lambda out: out.name == adapter.audio_output)
    metrics = state.metrics

    generated = [0]

    def count_audio() -> None:
        if metrics is not None and encoder.samples:
            metrics.audio_seconds.labels(body.model).inc(encoder.samples / float(adapter.sample_rate))

    def audio_bytes(out: Any) -> bytes:
        if out is not None and out.name == adapter.token_output:
            generated[0] += 1
        if out is None or out.name != adapter.audio_output:
            return b""
        pcm = adapter.audio_chunk(out.value)
        if encoder.samples == 0 and pcm.size and metrics is not None:
            metrics.ttfa.labels(body.model).observe(time.perf_counter() - started)
        return encoder.chunk(pcm)

    async def audio_stream():
        async with cancel_on_exit(handle):
            yield b"".join(audio_bytes(out) for out in held)
            async for out in rest:
                data = audio_bytes(out)
                if data:
                    yield data
            yield encoder.finish()
            count_audio()

    async def sse_stream():
        async with cancel_on_exit(handle):
            try:
                for out in held:
                    data = audio_bytes(out)
                    if data:
                        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                async for out in rest:
                    data = audio_bytes(out)
                    if data:
                        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                tail = encoder.finish()
                if tail:
                    yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
                env = await handle.result()
                count_audio()
                yield sse({"type": "speech.audio.done", "usage": _usage(adapter, env, handle.prepared, generated[0])})
            except Exception as exc:
                yield sse({"type": "error", **stream_error_payload(exc)})

    headers = {"X-Sample-Rate": str(adapter.sample_rate), "Cache-Control": "no-cache"}
    if body.stream_format == "sse":
        return StreamingResponse(sse_stream(), media_type="text/event-stream", headers=headers)
    return CutOnErrorStreamingResponse(audio_stream(), media_type=encoder.media_type, headers=headers)


def _usage(adapter: Any, env: dict[str, Any], inputs: dict[str, Any], generated: int) -> dict[str, int]:
    prompt = adapter.prompt_tokens(env, inputs)
    return {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated}
