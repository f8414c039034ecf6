"""POST /v1/images/generations and /v1/images/edits: routed to a model's images adapter."""

from __future__ import annotations

import asyncio
import base64
import binascii
import email.parser
import email.policy
import json
import time
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from mstar_core.api.http.errors import ApiError, from_request_error
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.media import check_image_bytes
from mstar_core.api.requests.adapters import api_named
from mstar_core.api.requests.choices import forks_choices
from mstar_core.api.requests.schemas import (
    ERROR_RESPONSES,
    ImageEditRequest,
    ImageRequest,
    ImagesResponse,
)
from mstar_core.api.requests.submit import adapter_call, map_result, result_or_disconnect, submit
from mstar_core.errors import RequestError
from mstar_core.sampling import check_fields, choice_seed

router = json_router()  # large JSON bodies parsed off the event loop

@router.post("/v1/images/generations", response_model=ImagesResponse, responses=ERROR_RESPONSES,
             summary="Generate images (OpenAI-compatible)")
async def create_images(body: ImageRequest, request: Request):
    return await _run(body, request, edit=False)


@router.post("/v1/images/edits", response_model=ImagesResponse, responses=ERROR_RESPONSES,
             summary="Edit an image (JSON with the source image as base64 in `image`, or multipart/form-data "
                     "with an `image` file, as the openai client sends it)",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/json": {"schema": ImageEditRequest.model_json_schema()}}}})
async def edit_images(request: Request):
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        data = multipart_fields(request.headers["content-type"], await request.body())
    else:
        try:
            data = json.loads(await request.body())
        except ValueError:
            raise ApiError(400, "the body must be JSON (or multipart/form-data with an 'image' file)") from None
    try:
        body = ImageEditRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    try:
        base64.b64decode(body.image, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "'image' must be a base64-encoded PNG or JPEG", param="image") from None
    return await _run(body, request, edit=True)


def multipart_fields(content_type: str, raw: bytes) -> dict[str, Any]:
    """A multipart/form-data body as edit fields: the `image` file base64-encoded, other values JSON-read if they parse."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw)
    if not message.is_multipart():
        raise ApiError(400, "malformed multipart/form-data body")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = (part.get_param("name", header="content-disposition") or "").removesuffix("[]")
        payload = part.get_payload(decode=True) or b""
        if name == "image" or part.get_filename() is not None:
            fields[name] = base64.b64encode(payload).decode()
            continue
        text = payload.decode("utf-8", errors="replace")
        try:
            fields[name] = json.loads(text) if name not in ("prompt", "model", "size", "response_format") else text
        except ValueError:
            fields[name] = text
    if "image" not in fields:
        raise ApiError(400, "the form has no 'image' file", param="image")
    return fields


async def _run(body: ImageRequest, request: Request, *, edit: bool) -> dict[str, Any]:
    state = request.app.state.mstar
    request.state.model = body.model
    adapter = state.adapter(body.model, "images")
    payload = body.model_dump()
    if payload.get("size") == "auto":  # OpenAI's word for what an absent size means
        payload["size"] = None
    if payload.get("size") is None and not edit:
        # the model's default size (its declared width and height); a model that declares none draws at 512x512
        w, h = adapter.field_default("images", "width"), adapter.field_default("images", "height")
        payload["size"] = f"{w}x{h}" if w is not None and h is not None else "512x512"
    check_fields(payload)
    if edit:
        payload["image"] = base64.b64decode(payload["image"])
        try:  # the declared size from the header, before any model decodes a pixel (an image bomb is a 413 here)
            check_image_bytes(payload["image"], "image", state.media_limits[(body.model, "images")])
        except RequestError as exc:
            raise from_request_error(exc) from None
    handles = []
    # a model that declares it (`RequestSchema.draws_n`) draws the n images in one request (sharing the prompt's prefill)
    shared = body.n > 1 and forks_choices(adapter)
    try:
        for i in range(1 if shared else body.n):
            one = dict(payload, n=body.n if shared else 1, index=i)
            if not shared:
                one["seed"] = choice_seed(body.seed, i)  # image i: what one request seeded seed + i draws
            inputs = adapter_call(adapter.image_inputs, one, edit=edit, what=f"the images adapter of '{body.model}'")
            try:
                handles.append(await submit(state, body.model, inputs))
            except ApiError as exc:  # the model's schema names its fields (width); the client sent the API's (size)
                raise api_named(exc, adapter, "images") from None
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
