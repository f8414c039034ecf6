"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters served at runtime, with vLLM's bodies.

A loaded adapter is then a model of its own name: `model=<lora_name>` on chat or completions runs the base model
under it, and `GET /v1/models` lists it with its `parent`. A directory that does not fit (missing file, rank over
the server's bound, a target the model does not have) is a 400 naming it; a name in use a 400; unloading an adapter
a request still runs under a 409.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from mstar_core.api.http.errors import ApiError, from_request_error
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.requests.schemas import ERROR_RESPONSES
from mstar_core.errors import ConfigError, RequestError

router = json_router()  # large JSON bodies parsed off the event loop


class LoadLoraAdapter(BaseModel):
    """vLLM's body: the adapter's name and its PEFT directory on the server's disk (and, with several models that
    take adapters, the base model)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, description="the model name requests use for the adapter")
    lora_path: str = Field(min_length=1, description="a PEFT LoRA directory on the server")
    model: str | None = Field(None, description="the base model (default: the one model that takes adapters)")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="accepted for vLLM's clients; the name decides")


def _engine(request: Request):
    state = request.app.state.mstar
    request.state.model = "-"
    if not state.ready:
        raise ApiError(503, "models are still loading; retry shortly (GET /health says when ready)")
    return state.engine


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES,
             summary="Load a LoRA adapter (vLLM-compatible)")
async def load_lora_adapter(body: LoadLoraAdapter, request: Request):
    engine = _engine(request)
    try:
        await engine.load_lora_adapter(body.lora_name, body.lora_path, model=body.model)
    except ConfigError as exc:
        raise ApiError(400, str(exc), param="lora_path") from None
    except RequestError as exc:
        raise from_request_error(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES,
             summary="Unload a LoRA adapter (vLLM-compatible)")
async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request):
    engine = _engine(request)
    try:
        await engine.unload_lora_adapter(body.lora_name)
    except RequestError as exc:
        raise from_request_error(exc) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
