"""/v1/videos: video generation jobs in the shape of OpenAI's videos API (create, retrieve, list, delete, content).

`POST /v1/videos` takes multipart/form-data (as the official client sends it: `prompt`, `model`, `size`,
`seconds`, an optional `input_reference` image file, and extra fields such as `seed`) or JSON. The request
is checked and prepared before the answer, so a bad field is a 4xx naming it; the job then runs on its
own (`mstar_core.api.requests.video_jobs`). How `size` and `seconds` become frames and pixels is the
model adapter's (Wan: sides floored to multiples of 32, `seconds x fps + 1` frames).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from mstar_core.api.http.errors import ApiError, from_request_error
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.media import check_image_bytes
from mstar_core.api.requests.adapters import api_named
from mstar_core.api.requests.submit import adapter_call, submit
from mstar_core.api.requests.video_jobs import follow_video_job, owner_of
from mstar_core.errors import RequestError

router = json_router()  # large JSON bodies parsed off the event loop

SIZE = re.compile(r"^\s*(\d{1,5})\s*x\s*(\d{1,5})\s*$")
MAX_SECONDS = 60
DEFAULT_SIZE, DEFAULT_SECONDS = "720x1280", "4"
_TEXT_FIELDS = ("prompt", "model", "size", "seconds", "negative_prompt")


async def _body(request: Request) -> dict[str, Any]:
    kind = request.headers.get("content-type", "")
    if kind.startswith("multipart/form-data"):
        try:
            form = await request.form()
        except Exception as exc:  # a malformed multipart body is the client's
            raise ApiError(400, f"malformed multipart/form-data body: {exc}") from None
        body: dict[str, Any] = {}
        for name, value in form.multi_items():
            if hasattr(value, "read"):  # an uploaded file
                body[name] = await value.read()
            elif name in _TEXT_FIELDS:
                body[name] = value
            else:
                try:
                    body[name] = json.loads(value)
                except ValueError:
                    body[name] = value
        return body
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise ApiError(400, "the body must be multipart/form-data or JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be an object")
    return body


def _checked(body: dict[str, Any]) -> dict[str, Any]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError(400, "'prompt' is required: a non-empty string", param="prompt")
    size = str(body.get("size") or DEFAULT_SIZE)
    if not SIZE.match(size) or min(int(v) for v in SIZE.match(size).groups()) < 1:
        raise ApiError(400, f"'size' must be WIDTHxHEIGHT, e.g. 1280x720, got {size!r}", param="size")
    seconds = str(body.get("seconds") or DEFAULT_SECONDS)
    if not seconds.isdigit() or not 1 <= int(seconds) <= MAX_SECONDS:
        raise ApiError(400, f"'seconds' must be a whole number of seconds from 1 to {MAX_SECONDS} (OpenAI's: 4, 8, "
                            f"12), got {seconds!r}", param="seconds")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ApiError(400, f"'seed' must be a non-negative integer, got {seed!r}", param="seed")
    reference = body.get("input_reference")
    if reference is not None and not isinstance(reference, bytes | bytearray):
        raise ApiError(400, "'input_reference' must be an uploaded image file (PNG or JPEG)", param="input_reference")
    return dict(body, prompt=prompt, size=size, seconds=seconds)


def _model(state: Any, body: dict[str, Any]) -> str:
    model = body.get("model")
    if model:
        return str(model)
    serving = sorted(m for (m, r) in state.adapters if r == "videos")
    if len(serving) != 1:
        raise ApiError(400, f"'model' is required: models serving videos: {', '.join(serving) or 'none'}", param="model")
    return serving[0]


@router.post("/v1/videos", summary="Create a video job (OpenAI-compatible; multipart with an optional "
                                    "`input_reference` image, or JSON)")
async def create_video(request: Request):
    state = request.app.state.mstar
    body = _checked(await _body(request))
    model = _model(state, body)
    request.state.model = model
    adapter = state.adapter(model, "videos")
    if body.get("input_reference") is not None:
        try:
            check_image_bytes(bytes(body["input_reference"]), "input_reference", state.media_limits[(model, "videos")])
        except RequestError as exc:
            raise from_request_error(exc) from None
    store = state.video_jobs
    job = store.admit(owner_of(request.headers.get("authorization")), model=model, prompt=body["prompt"],
                      size=body["size"], seconds=body["seconds"])
    try:
        inputs = adapter_call(adapter.video_inputs, body, what=f"the videos adapter of '{model}'")
        try:
            handle = await submit(state, model, inputs)
        except ApiError as exc:  # the model's schema names its fields (height); the client sent the API's (size)
            raise api_named(exc, adapter, "videos") from None
    except BaseException:
        store.discard(job)
        raise
    store.launch(job, lambda j: follow_video_job(j, store=store, handle=handle, adapter=adapter))
    return job.public()


@router.get("/v1/videos", summary="List this API key's video jobs")
async def list_videos(request: Request, after: str | None = None, limit: int = 20, order: str = "desc"):
    request.state.model = "-"
    if not 1 <= limit <= 100:
        raise ApiError(400, f"'limit' must be from 1 to 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"'order' must be 'asc' or 'desc', got {order!r}", param="order")
    return request.app.state.mstar.video_jobs.list(owner_of(request.headers.get("authorization")), after, limit, order)


@router.get("/v1/videos/{video_id}", summary="A video job's status and progress")
async def retrieve_video(video_id: str, request: Request):
    request.state.model = "-"
    job = request.app.state.mstar.video_jobs.get(owner_of(request.headers.get("authorization")), video_id)
    return job.public()


@router.delete("/v1/videos/{video_id}", summary="Delete a video job (a running one is cancelled, its state freed)")
async def delete_video(video_id: str, request: Request):
    request.state.model = "-"
    return request.app.state.mstar.video_jobs.delete(owner_of(request.headers.get("authorization")), video_id)


@router.get("/v1/videos/{video_id}/content", response_class=Response,
            responses={200: {"content": {"video/mp4": {}}}}, summary="The finished video (MP4)")
async def video_content(video_id: str, request: Request, variant: str = "video"):
    request.state.model = "-"
    job = request.app.state.mstar.video_jobs.get(owner_of(request.headers.get("authorization")), video_id)
    if variant != "video":
        raise ApiError(400, f"'variant' {variant!r} is not served; this server returns the MP4 ('video')",
                       param="variant")
    if job.status != "completed" or job.mp4 is None:
        raise ApiError(409, f"video '{video_id}' is {job.status}, not completed"
                            + (f": {job.error['message']}" if job.error else "; poll GET /v1/videos/{id}"),
                       param="video_id", code="video_not_ready")
    return Response(job.mp4, media_type="video/mp4")
