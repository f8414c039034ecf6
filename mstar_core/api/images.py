"""POST /v1/images/generations and /v1/images/edits: routed to a model's images adapter."""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from typing import Any

from fastapi import APIRouter, Request

from mstar_core.api.common import adapter_call, map_result, result_or_disconnect, submit
from mstar_core.api.errors import ApiError
from mstar_core.api.schemas import (
    ERROR_RESPONSES,
    ImageEditRequest,
    ImageRequest,
    ImagesResponse,
)
from mstar_core.sampling import MAX_SEED, check_fields

router = APIRouter()

@router.post("/v1/images/generations", response_model=ImagesResponse, responses=ERROR_RESPONSES,
             summary="Generate images (OpenAI-compatible)")
async def create_images(body: ImageRequest, request: Request):
    return await _run(body, request, edit=False)


@router.post("/v1/images/edits", response_model=ImagesResponse, responses=ERROR_RESPONSES,
             summary="Edit an image (JSON body; the source image as base64 in `image`)")
async def edit_images(body: ImageEditRequest, request: Request):
    try:
        base64.b64decode(body.image, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "'image' must be a base64-encoded PNG or JPEG", param="image") from None
    return await _run(body, request, edit=True)


async def _run(body: ImageRequest, request: Request, *, edit: bool) -> dict[str, Any]:
    state = request.app.state.mstar
    request.state.model = body.model
    adapter = state.adapter(body.model, "images")
    payload = body.model_dump()
    check_fields(payload)
    if edit:
        payload["image"] = base64.b64decode(payload["image"])
    handles = []
    try:
        for i in range(body.n):
            one = dict(payload, n=1, index=i)
            if body.seed is not None:
                one["seed"] = (body.seed + i) % (MAX_SEED + 1)  # distinct but reproducible images, still in range
            inputs = adapter_call(adapter.image_inputs, one, edit=edit, what=f"the images adapter of '{body.model}'")
            handles.append(await submit(state, body.model, inputs))
        if len(handles) == 1:
            envs = [await result_or_disconnect(request, handles[0])]
        else:
            tasks = [asyncio.ensure_future(h.result()) for h in handles]
            await asyncio.wait(tasks)
            envs = [map_result(t) for t in tasks]
        data = []
        for env in envs:
            for png in adapter_call(adapter.images_from_env, env, what=f"the images adapter of '{body.model}'"):
                data.append({"b64_json": base64.b64encode(png).decode()})
        return {"created": int(time.time()), "data": data}
    finally:
        for h in handles:
            h.cancel()
