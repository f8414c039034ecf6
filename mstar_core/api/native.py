"""POST /v1/walks/{model}: the native endpoint; runs a model's walk plan on JSON inputs, streams NDJSON events."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mstar_core.api.common import (
    cancel_on_exit,
    first_then_rest,
    result_or_disconnect,
    stream_error_payload,
    submit,
)
from mstar_core.api.errors import ApiError
from mstar_core.api.responses import OrjsonResponse, json_bytes
from mstar_core.api.schemas import ERROR_RESPONSES, WalkRequest
from mstar_core.api.tensors import decode_inputs, encode_value
from mstar_core.errors import RequestError
from mstar_core.sampling import check_fields

router = APIRouter()

def _line(obj: Any) -> bytes:
    return json_bytes(obj) + b"\n"


def _outputs(loaded: Any, env: dict[str, Any], wanted: list[str] | None) -> dict[str, Any]:
    if wanted is None:
        wanted = list(dict.fromkeys(n for w in loaded.graph.walks.values() for n in w.outputs if n in env))
    missing = [n for n in wanted if n not in env]
    if missing:
        raise RequestError(f"requested outputs {missing} are not in the final env; available: {sorted(env)}")
    return {n: encode_value(env[n]) for n in wanted}


@router.post(
    "/v1/walks/{model}",
    responses={200: {"content": {"application/x-ndjson": {}},
                     "description": "NDJSON events: {event: output, name, walk, value} ... then {event: done, outputs}"},
               **ERROR_RESPONSES},
    summary="Run a model's walks on raw inputs (native endpoint)",
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
    handle = submit(state, model, inputs)
    if not body.stream:
        env = await result_or_disconnect(request, handle)
        try:
            return OrjsonResponse({"outputs": _outputs(loaded, env, body.outputs)})
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
                yield _line({"event": "done", "outputs": _outputs(loaded, env, body.outputs)})
            except Exception as exc:
                yield _line({"event": "error", **stream_error_payload(exc)})

    return StreamingResponse(events(), media_type="application/x-ndjson")
