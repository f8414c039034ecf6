"""POST /v1/chat/completions: messages (text, images, audio) in, tokens out (SSE chunks and [DONE] when
streaming); `n` choices; a spoken reply (`message.audio`, `delta.audio`) from models that speak in chat."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from mstar_core.api.http.bodies import OrjsonResponse
from mstar_core.api.http.errors import ApiError
from mstar_core.api.http.json_bodies import json_router
from mstar_core.api.http.off_loop import off_loop_when
from mstar_core.api.requests import choices as ch
from mstar_core.api.requests.chat_adapter import ROUTE_FIELDS
from mstar_core.api.requests.chat_audio import AudioReply, check_audio_request
from mstar_core.api.requests.chat_tools import ChatTools
from mstar_core.api.requests.formats import response_format_grammar
from mstar_core.api.requests.logprobs import chat_logprobs
from mstar_core.api.requests.pipeline import chat_request, check_stops, sampling_payload, with_choice
from mstar_core.api.requests.schemas import ERROR_RESPONSES, ChatCompletion, ChatRequest
from mstar_core.api.requests.submit import sse, unless_disconnected

router = json_router()  # large JSON bodies parsed off the event loop


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={200: {"content": {"text/event-stream": {}}, "description": "completion, or SSE chunks then [DONE]"},
               **ERROR_RESPONSES},
    summary="Chat completion (OpenAI-compatible)",
)
async def create_chat_completion(body: ChatRequest, request: Request):
    state = request.app.state.mstar
    request.state.model = body.model
    adapter = state.adapter(body.model, "chat")
    audio = check_audio_request(adapter, body.model, body)
    # schema and tool checks walk what the client sent (a few hundred KB): off the loop, as everything that scales
    grammar = await off_loop_when(body.response_format is not None, response_format_grammar,
                                  body.response_format)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    ch.check_n(state, body.n)
    stops = check_stops(body.stop)
    payload = sampling_payload(body, ROUTE_FIELDS["chat"])
    max_tokens = body.max_completion_tokens or body.max_tokens
    payload["max_tokens"] = max_tokens
    payload["audio"] = audio  # {voice, format} (the voice's custom-object form read) or None
    calling = await off_loop_when(getattr(body, "tools", None) is not None, ChatTools.from_body, body, adapter, grammar)
    # a client gone while its grammar compiles (or its media decode) stops that work
    inputs = await unless_disconnected(request, chat_request(state, adapter, body.model, payload, tools=calling,
                                                             response_format=grammar))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    started = time.perf_counter()
    make_audio = None
    if audio is not None:
        def first_audio() -> None:
            if state.metrics is not None:
                state.metrics.ttfa.labels(body.model).observe(time.perf_counter() - started)

        def make_audio() -> AudioReply:
            return AudioReply(adapter, audio["format"], stream=body.stream, on_first_audio=first_audio)
    choices = await ch.start_choices(
        request, state, body.model, adapter, [inputs], body.n,
        lambda prompt, i: with_choice(adapter, prompt, body.seed, i, logprobs), stops, max_tokens, started,
        make_audio)
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())

    def lp(entries: list[ch.TokenLogprob]) -> dict[str, Any] | None:
        return chat_logprobs(adapter, entries) if logprobs is not None else None

    def message(c: ch.Choice) -> dict[str, Any]:
        if c.audio is None:
            return calling.message(c.text.text)
        return {"role": "assistant", "content": None,
                "audio": {"id": c.audio.id, "data": base64.b64encode(c.audio.take()).decode(),
                          "expires_at": created, "transcript": c.transcript}}

    if not body.stream:
        await ch.run_all(request, choices)
        return OrjsonResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": body.model,
            "choices": [{"index": c.index, "message": (m := message(c)), "logprobs": lp(c.logprobs),
                         "finish_reason": "tool_calls" if m.get("tool_calls") else c.finish_reason} for c in choices],
            "usage": ch.usage(adapter, choices),
        })

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": choice_list, **extra})

    def audio_deltas(choice: ch.Choice, text: str, entries: list[ch.TokenLogprob], done: bool):
        # OpenAI's streamed audio: transcript pieces and base64 data under delta.audio, then its expiry alone
        aid = choice.audio.id
        if text or entries:
            yield chunk([{"index": choice.index, "delta": {"audio": {"id": aid, "transcript": text}},
                          "logprobs": lp(entries), "finish_reason": None}])
        data = choice.audio.take()
        if data:
            yield chunk([{"index": choice.index, "delta": {"audio": {"id": aid, "data": base64.b64encode(data).decode()}},
                          "logprobs": None, "finish_reason": None}])
        if done:
            yield chunk([{"index": choice.index, "delta": {"audio": {"id": aid, "expires_at": created}},
                          "logprobs": None, "finish_reason": None}])

    async def chunks():
        for c in choices:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": "" if c.audio is None else None},
                          "logprobs": None, "finish_reason": None}])
        async for choice, text, entries, done in ch.events(choices):
            if choice.audio is not None:
                for data in audio_deltas(choice, text, entries, done):
                    yield data
            elif calling.active:
                for delta in calling.deltas(choice.index, text, done):
                    yield chunk([{"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}])
            elif text or entries:
                yield chunk([{"index": choice.index, "delta": {"content": text}, "logprobs": lp(entries),
                              "finish_reason": None}])
            if done:
                reason = "tool_calls" if calling.called(choice.index) else choice.finish_reason
                yield chunk([{"index": choice.index, "delta": {}, "logprobs": None, "finish_reason": reason}])

    usage = (lambda: chunk([], usage=ch.usage(adapter, choices))) if include_usage else None
    return StreamingResponse(ch.sse_body(chunks(), choices, usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
