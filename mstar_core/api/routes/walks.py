"""POST /v1/walks/{model}: the native endpoint; runs a model's walk plan on JSON inputs, streams NDJSON events."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from mstar_core.api.http.bodies import OrjsonResponse, json_bytes
from mstar_core.api.http.errors import ApiError
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.media.tensors import decode_inputs, encode_value
from mstar_core.api.requests.schemas import ERROR_RESPONSES, WalkRequest
from mstar_core.api.requests.submit import (
    cancel_on_exit,
    first_then_rest,
    result_or_disconnect,
    stream_error_payload,
    submit,
)
from mstar_core.errors import RequestError
from mstar_core.sampling import check_fields

router = json_router()  # large JSON bodies parsed off the event loop
WALKS_PATH = "/v1/walks/{model}"

def _line(obj: Any) -> bytes:
    return json_bytes(obj) + b"\n"


def _outputs(loaded: Any, env: dict[str, Any], wanted: list[str] | None, walks: list[str]) -> dict[str, Any]:
    """The names the request asked for, else the declared outputs of the walks it ran (not of every walk)."""
    if wanted is None:
        wanted = [n for n in loaded.graph.declared_outputs(walks) if n in env]
    missing = [n for n in wanted if n not in env]
    if missing:
        raise RequestError(f"requested outputs {missing} are not in the final env; available: {sorted(env)}")
    return {n: encode_value(env[n]) for n in wanted}


@router.post(
    WALKS_PATH,
    responses={200: {"content": {"application/x-ndjson": {}},
                     "description": "NDJSON events: {event: output, name, walk, value} ... then {event: done, outputs}"},
               **ERROR_RESPONSES},
    summary="Run a model's walks on raw inputs (native endpoint)",
    description="Each served model that declares its request fields has its own entry below, "
                "`/v1/walks/<model>`, with its inputs, bounds, defaults and an example.",
)
async def run_walks(model: str, body: WalkRequest, request: Request):
    state = request.app.state.mstar
    request.state.model = model
    loaded = state.loaded(model)
    try:
        # the names SamplingParams knows mean the same on every model: checked here, before any model sees them
        check_fields(body.inputs, where="inputs.")
        inputs = decode_inputs(body.inputs)
    except RequestError as exc:
        raise ApiError(400, str(exc), param=exc.param or "inputs") from None
    handle = await submit(state, model, inputs)
    if not body.stream:
        env = await result_or_disconnect(request, handle)
        try:
            return OrjsonResponse({"outputs": _outputs(loaded, env, body.outputs, handle.walks)})
        except RequestError as exc:
            raise ApiError(400, str(exc), param="outputs") from None
    first, rest = await first_then_rest(request, handle)

    def event(out: Any) -> bytes:
        return _line({"event": "output", "name": out.name, "walk": out.walk, "value": encode_value(out.value)})

    async def events():
        async with cancel_on_exit(handle):
            try:
                if first is not None:
                    yield event(first)
                async for out in rest:
                    yield event(out)
                env = await handle.result()
                yield _line({"event": "done", "outputs": _outputs(loaded, env, body.outputs, handle.walks)})
            except Exception as exc:
                yield _line({"event": "error", **stream_error_payload(exc)})

    return StreamingResponse(events(), media_type="application/x-ndjson")


def document_models(schema: dict[str, Any], models: dict[str, Any]) -> None:
    """Add one `/v1/walks/<model>` operation per served model with a request schema to an OpenAPI document.

    The route is the same `/v1/walks/{model}`; the per-model entries show each model's inputs (types,
    bounds, defaults, descriptions, an example), which one shared body cannot.
    """
    from mstar_core.schema import TENSOR_JSON_SCHEMA

    generic = schema.get("paths", {}).get(WALKS_PATH, {}).get("post")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    base = components.get("WalkRequest")
    if generic is None or base is None:
        return
    for name, loaded in sorted(models.items()):
        request_schema = getattr(loaded, "request_schema", None)
        if request_schema is None:
            continue
        components.setdefault("Tensor", TENSOR_JSON_SCHEMA)
        key = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
        components[f"{key}.inputs"] = {"title": f"{name} inputs", **request_schema.json_schema()}
        body = {**base, "title": f"{name} walk request",
                "properties": {**base["properties"], "inputs": {"$ref": f"#/components/schemas/{key}.inputs"}},
                "required": ["inputs"]}
        if request_schema.example is not None:
            body["examples"] = [{"inputs": dict(request_schema.example), "stream": False}]
        components[f"{key}.WalkRequest"] = body
        op = {k: v for k, v in generic.items() if k not in ("parameters", "requestBody", "operationId", "description")}
        op.update(
            operationId=f"run_walks_{key}",
            summary=f"{name}: run its walks ({', '.join(loaded.graph.walks)})",
            description=request_schema.description or f"The native endpoint of model '{name}'.",
            tags=["walks"],
            requestBody={"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{key}.WalkRequest"}}}},
        )
        schema["paths"][f"/v1/walks/{name}"] = {"post": op}
