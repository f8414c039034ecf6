"""`POST/GET/DELETE /v1/audio/voices`: cloned voices, created from reference audio, kept per API key.

`POST` (multipart): `model` (a model whose adapter clones voices), `file` (WAV, FLAC, OGG or MP3; at most 30 s and
8 MiB), `consent` (true: the speaker agreed to be cloned), optional `transcript` (what the audio says) and `name`.
The model turns the audio into the voice's prompt once, here: with a transcript, the reference audio's codes too
(Qwen3-TTS's in-context cloning), without one a speaker embedding only. `/v1/audio/speech` with `voice` = the
voice's id then runs no encoder. Each API key sees and uses only its own voices (`mstar_core.api.requests.voices`).
"""

from __future__ import annotations

import asyncio

from fastapi import Form, Request, UploadFile
from fastapi.responses import Response

from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.media import MediaLimits
from mstar_core.api.media.upload import decode_upload
from mstar_core.api.requests.schemas import ERROR_RESPONSES
from mstar_core.api.requests.voices import (
    MAX_REFERENCE_BYTES,
    MAX_REFERENCE_SECONDS,
    caller_scope,
)

router = json_router()  # large JSON bodies parsed off the event loop
_YES = {"true", "yes", "1", "on"}


@router.post("/v1/audio/voices", responses=ERROR_RESPONSES, summary="Create a cloned voice from reference audio",
             response_class=Response)
async def create_voice(request: Request, model: str = Form(...), file: UploadFile | None = None,
                       transcript: str | None = Form(None), consent: str | None = Form(None),
                       name: str | None = Form(None)) -> Response:
    state = request.app.state.mstar
    request.state.model = model
    adapter = state.adapter(model, "speech")
    if not getattr(adapter, "clones_voices", False):
        raise ApiError(400, f"model '{model}' does not clone voices (a Base checkpoint does)", param="model")
    if (consent or "").strip().lower() not in _YES:
        raise ApiError(400, "'consent' must be true: the speaker of the reference audio agreed to have their voice "
                            "cloned", param="consent")
    if transcript is not None and not transcript.strip():
        raise ApiError(400, "'transcript' is blank: send the text the reference audio speaks, or leave it out (the "
                            "voice then clones from a speaker embedding alone)", param="transcript")
    transcript = (transcript or "").strip()
    if len(transcript) > 4096:
        raise ApiError(400, "'transcript' is longer than 4096 characters", param="transcript")
    if name is not None and len(name) > 128:
        raise ApiError(400, "'name' is longer than 128 characters", param="name")
    if file is None:
        raise ApiError(400, "'file' is required: the reference audio", param="file")
    store, scope = state.voices, caller_scope(request.headers)
    raw = await file.read(MAX_REFERENCE_BYTES + 1)
    store.room_for(scope, len(raw))  # over the bound: refused before decoding or running the encoder
    samples, rate = decode_upload(raw, MediaLimits(max_audio_bytes=MAX_REFERENCE_BYTES,
                                                   max_audio_seconds=MAX_REFERENCE_SECONDS))
    # the encoder runs once, off the event loop; its result is the voice
    prompt = await asyncio.to_thread(adapter.clone_voice, samples, rate, transcript)
    voice = store.add(scope, name=name or file.filename or "voice", model=model, transcript=transcript,
                      audio_bytes=len(raw), prompt=prompt)
    return OrjsonResponse(voice.public())


@router.get("/v1/audio/voices", responses=ERROR_RESPONSES, summary="List this API key's cloned voices")
async def list_voices(request: Request, model: str | None = None) -> Response:
    voices = request.app.state.mstar.voices.list(caller_scope(request.headers))
    return OrjsonResponse({"object": "list",
                           "data": [v.public() for v in voices if model is None or v.model == model]})


@router.get("/v1/audio/voices/{voice_id}", responses=ERROR_RESPONSES, summary="One of this API key's voices")
async def get_voice(request: Request, voice_id: str) -> Response:
    return OrjsonResponse(request.app.state.mstar.voices.get(caller_scope(request.headers), voice_id).public())


@router.delete("/v1/audio/voices/{voice_id}", responses=ERROR_RESPONSES, summary="Delete one of this API key's voices")
async def delete_voice(request: Request, voice_id: str) -> Response:
    voice = request.app.state.mstar.voices.delete(caller_scope(request.headers), voice_id)
    return OrjsonResponse({"id": voice.id, "object": "audio.voice.deleted", "deleted": True})
