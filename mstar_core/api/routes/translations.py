"""POST /v1/audio/translations: an audio file (multipart) in, its English text out, from a model with a
`transcriptions` adapter (Whisper's `translate` task); the response formats and streaming are the transcription
route's (`requests.transcribe`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Form, Request, UploadFile

from mstar_core.api.media import MediaLimits
from mstar_core.api.media.upload import decode_upload
from mstar_core.api.requests.schemas import ERROR_RESPONSES
from mstar_core.api.requests.transcribe import transcribe
from mstar_core.sampling import check_openai

router = APIRouter()


@router.post("/v1/audio/translations", responses={200: {"content": {"text/event-stream": {}, "text/plain": {}}},
                                                  **ERROR_RESPONSES},
             summary="Translate audio into English text (OpenAI-compatible)")
async def create_translation(request: Request, file: UploadFile, model: str = Form(...),
                             prompt: str | None = Form(None), response_format: str = Form("json"),
                             temperature: float = Form(0.0), stream: bool = Form(False)):
    state = request.app.state.mstar
    request.state.model = model
    adapter = state.adapter(model, "transcriptions")  # a 404 naming the models that translate, for any other
    check_openai("temperature", temperature)
    limits = state.media_limits.get((model, "transcriptions")) or MediaLimits().with_env()
    raw = await file.read(limits.max_audio_bytes + 1)
    samples, rate = await asyncio.to_thread(decode_upload, raw, limits)  # decoding and resampling: off the loop
    return await transcribe(request, state, adapter, model, samples, rate, task="translate", language=None,
                            prompt=prompt, response_format=response_format, temperature=temperature, stream=stream,
                            timestamps=False)
