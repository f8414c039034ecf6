"""POST /v1/audio/speech: text in, audio streamed out as the model produces it (WAV/PCM bytes or SSE)."""

from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from mstar_core.api.audio import AudioEncoder
from mstar_core.api.common import (
    adapter_call,
    cancel_on_exit,
    first_then_rest,
    sse,
    stream_error_payload,
    submit,
)
from mstar_core.api.errors import ApiError
from mstar_core.api.responses import CutOnErrorStreamingResponse
from mstar_core.api.schemas import ERROR_RESPONSES, SpeechRequest
from mstar_core.sampling import check_fields

router = APIRouter()

@router.post(
    "/v1/audio/speech",
    responses={
        200: {"content": {"audio/wav": {}, "audio/pcm": {}, "audio/flac": {}, "text/event-stream": {}},
              "description": "audio bytes as produced, or SSE `speech.audio.delta` / `speech.audio.done` events"},
        **ERROR_RESPONSES,
    },
    response_class=Response,
    summary="Text to speech (OpenAI-compatible)",
)
async def create_speech(body: SpeechRequest, request: Request) -> Response:
    state = request.app.state.mstar
    request.state.model = body.model
    adapter = state.adapter(body.model, "speech")
    if adapter.voices and body.voice not in adapter.voices:
        raise ApiError(400, f"voice '{body.voice}' is not available for model '{body.model}'; "
                            f"choose one of: {', '.join(adapter.voices)}", param="voice")
    if body.speed != 1.0 and not adapter.supports_speed:
        raise ApiError(400, f"model '{body.model}' only speaks at speed 1.0; drop 'speed'", param="speed")
    payload = body.model_dump()
    check_fields(payload)  # sampling extras (seed, temperature, max_tokens, ...) mean the same for every model
    inputs = adapter_call(adapter.speech_inputs, payload, what=f"the speech adapter of '{body.model}'")
    started = time.perf_counter()
    handle = await submit(state, body.model, inputs)
    streaming = (payload.get("stream") is not False) or body.stream_format == "sse"
    encoder = AudioEncoder(body.response_format, int(adapter.sample_rate), stream=streaming)
    first, rest = await first_then_rest(request, handle)
    metrics = state.metrics

    generated = [0]

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
            yield audio_bytes(first)
            async for out in rest:
                data = audio_bytes(out)
                if data:
                    yield data
            yield encoder.finish()

    async def sse_stream():
        async with cancel_on_exit(handle):
            try:
                outs = [first] if first is not None else []
                for out in outs:
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
