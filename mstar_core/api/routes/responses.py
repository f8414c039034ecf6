"""POST /v1/responses (OpenAI's Responses API) over any chat model, and GET / DELETE /v1/responses/{id}.

A request becomes a chat turn: `instructions` as the system message, the stored conversation of
`previous_response_id` (not its instructions), then `input` (a string, or message, function_call and
function_call_output items; text and images where the model's chat takes them). `tools` (flat function tools),
`tool_choice`, `text.format` and `max_output_tokens` mean what they mean in chat. The conversation is rendered
again in full, so a continuation's prompt starts with the previous prompt and reply: the engine's prefix cache
holds those pages and prefills only what follows them. Stored responses live in a bounded store with a time limit
(`response_store`); `store: false` keeps nothing.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.http.off_loop import off_loop_when
from mstar_core.api.requests import choices as ch
from mstar_core.api.requests.chat_tools import ChatTools
from mstar_core.api.requests.formats import response_format_grammar
from mstar_core.api.requests.pipeline import chat_request, sampling_fields
from mstar_core.api.requests.response_items import (
    ResponseBuilder,
    check_stored_fields,
    event_stream,
    input_messages,
    text_format,
    whole_output,
)
from mstar_core.api.requests.response_store import store_of
from mstar_core.api.requests.schemas import ERROR_RESPONSES, ResponsesRequest
from mstar_core.api.requests.submit import unless_disconnected

router = json_router()  # large JSON bodies parsed off the event loop
#: Fields the route takes; others a client may send are refused by name when set (not silently ignored).
_UNSUPPORTED = ("background", "reasoning", "include", "prompt", "conversation", "service_tier")


def _check_unsupported(body: ResponsesRequest) -> None:
    extra = body.model_extra or {}
    for name in _UNSUPPORTED:
        if extra.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"'{name}' is not supported by this server; leave it out", param=name)
    if body.truncation not in (None, "disabled"):
        raise ApiError(400, "'truncation' must be disabled (the conversation is never cut)", param="truncation")


@router.post("/v1/responses", responses={200: {"content": {"text/event-stream": {}},
                                               "description": "a response, or its events"}, **ERROR_RESPONSES},
             summary="Create a response (OpenAI's Responses API)")
async def create_response(body: ResponsesRequest, request: Request):
    state = request.app.state.mstar
    request.state.model = body.model
    adapter = state.adapter(body.model, "chat")
    _check_unsupported(body)
    check_stored_fields(body.metadata, body.user)
    store = store_of(request.app.state)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = store.get(body.previous_response_id)
        if prev is None:
            raise ApiError(404, f"'previous_response_id' {body.previous_response_id!r} is not a stored response (never "
                                "stored, deleted, or expired)", param="previous_response_id", code="response_not_found")
        history = copy.deepcopy(prev.messages)
    conversation = history + input_messages(body.input)
    prompt = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    # schema and tool checks walk what the client sent (a few hundred KB): off the loop
    fmt = text_format(body.text)
    grammar = await off_loop_when(fmt is not None, response_format_grammar, fmt, where="text.format")
    tools = await off_loop_when(body.tools is not None, ChatTools.from_body, body, adapter, grammar, flat=True)
    sampling = sampling_fields({"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                                "max_output_tokens": body.max_output_tokens}, {"max_output_tokens": "max_tokens"})
    payload: dict[str, Any] = {"model": body.model, "messages": prompt, **sampling}
    inputs = await unless_disconnected(request, chat_request(state, adapter, body.model, payload, tools=tools,
                                                             response_format=grammar, format_param="text.format"))
    started = time.perf_counter()
    choices = await ch.start_choices(request, state, body.model, adapter, [inputs], 1, lambda p, _i: dict(p), [],
                                     body.max_output_tokens, started)
    built = ResponseBuilder(body, tools)

    def keep() -> None:
        if body.store:
            store.put(built.snapshot(), conversation + built.assistant_messages())

    if not body.stream:
        await ch.run_all(request, choices)
        choice = choices[0]
        whole_output(built, tools, choice.text.text)
        built.finish(choice, adapter)
        keep()
        return OrjsonResponse(built.snapshot())
    return StreamingResponse(event_stream(built, tools, choices, adapter, keep), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES, summary="A stored response")
async def get_response(response_id: str, request: Request):
    item = store_of(request.app.state).get(response_id)
    if item is None:
        raise ApiError(404, f"no stored response {response_id!r}", param="response_id", code="response_not_found")
    return OrjsonResponse(item.response)


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES, summary="Delete a stored response")
async def delete_response(response_id: str, request: Request):
    if not store_of(request.app.state).delete(response_id):
        raise ApiError(404, f"no stored response {response_id!r}", param="response_id", code="response_not_found")
    return OrjsonResponse({"id": response_id, "object": "response", "deleted": True})
