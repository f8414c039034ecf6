"""POST /v1/chat/completions: messages in, tokens out (SSE chunks and [DONE] when streaming)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mstar_core.api.common import (
    adapter_call,
    cancel_on_exit,
    first_then_rest,
    result_or_disconnect,
    sse,
    stream_error_payload,
    submit,
)
from mstar_core.api.errors import ApiError
from mstar_core.api.responses import OrjsonResponse
from mstar_core.api.schemas import ERROR_RESPONSES, ChatCompletion, ChatRequest
from mstar_core.api.text import TextAssembler
from mstar_core.sampling import check_fields

router = APIRouter()

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
    if body.modalities and "audio" in body.modalities:
        raise ApiError(400, f"model '{body.model}' does not produce audio in chat; drop 'modalities'", param="modalities")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "'stop' takes up to 4 non-empty strings", param="stop")
    payload = body.model_dump()
    # sampling extras (top_k, min_p, ...) are checked like the declared fields; `logprobs` is OpenAI's bool here
    check_fields({k: v for k, v in payload.items() if k != "logprobs"})
    max_tokens = body.max_completion_tokens or body.max_tokens
    payload["max_tokens"] = max_tokens
    inputs = adapter_call(adapter.chat_inputs, payload, what=f"the chat adapter of '{body.model}'")
    started = time.perf_counter()
    handle = submit(state, body.model, inputs)
    text = TextAssembler(adapter, stops, max_tokens)
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    metrics = state.metrics

    def on_token(out: Any) -> str:
        if out is None or out.name != adapter.token_output:
            return ""
        if text.generated == 0 and metrics is not None:
            metrics.ttft.labels(body.model).observe(time.perf_counter() - started)
        delta = text.feed(int(out.value))
        if text.finish_reason is not None:
            handle.cancel()  # stop string, EOS or max_tokens reached: free the request now
        return delta

    if not body.stream:
        first, rest = await first_then_rest(request, handle)
        on_token(first)
        env: dict[str, Any] = {}
        if text.finish_reason is None:
            async for out in rest:
                on_token(out)
                if text.finish_reason is not None:
                    break
        if text.finish_reason is None:
            env = await result_or_disconnect(request, handle)
        handle.cancel()
        text.close(env)
        usage = _usage(adapter, env, handle.prepared, text)
        return OrjsonResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": body.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text.text},
                         "finish_reason": text.finish_reason}],
            "usage": usage,
        })

    first, rest = await first_then_rest(request, handle)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    async def events():
        async with cancel_on_exit(handle):
            try:
                yield chunk({"role": "assistant", "content": ""})
                delta = on_token(first)
                if delta:
                    yield chunk({"content": delta})
                if text.finish_reason is None:
                    async for out in rest:
                        delta = on_token(out)
                        if delta:
                            yield chunk({"content": delta})
                        if text.finish_reason is not None:
                            break
                env = await handle.result() if text.finish_reason is None else {}
                tail = text.close(env)
                if tail:
                    yield chunk({"content": tail})
                yield chunk({}, text.finish_reason)
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                               "choices": [], "usage": _usage(adapter, env, handle.prepared, text)})
            except Exception as exc:
                yield sse(stream_error_payload(exc))
            yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _usage(adapter: Any, env: dict[str, Any], inputs: dict[str, Any], text: TextAssembler) -> dict[str, int]:
    prompt = adapter.prompt_tokens(env, inputs)
    return {"prompt_tokens": prompt, "completion_tokens": text.generated, "total_tokens": prompt + text.generated}
