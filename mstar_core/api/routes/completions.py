"""POST /v1/completions: OpenAI's legacy text completions (a prompt or a batch of them in, `n` texts each out)."""

from __future__ import annotations

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
from mstar_core.api.requests.formats import response_format_grammar
from mstar_core.api.requests.logprobs import completion_logprobs
from mstar_core.api.requests.pipeline import check_stops, completion_requests, sampling_payload, with_choice
from mstar_core.api.requests.schemas import ERROR_RESPONSES, Completion, CompletionRequest
from mstar_core.api.requests.submit import sse, unless_disconnected

router = json_router()  # large JSON bodies parsed off the event loop

#: Prompts in one request (each gets its own `n` choices).
MAX_PROMPTS = 64


def split_prompts(prompt: Any) -> list[str | list[int]]:
    """The request's prompts: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise ApiError(400, "'prompt' must not be empty: send a string, a list of strings, token ids or a list of "
                            "token-id lists", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"'prompt' has {len(prompts)} prompts; send at most {MAX_PROMPTS} per request", param="prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise ApiError(400, f"'prompt' [{i}] is empty; every prompt needs at least one character or token",
                           param="prompt")
    return prompts


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={200: {"content": {"text/event-stream": {}}, "description": "completion, or SSE chunks then [DONE]"},
               **ERROR_RESPONSES},
    summary="Text completion (OpenAI's legacy completions)",
)
async def create_completion(body: CompletionRequest, request: Request):
    state = request.app.state.mstar
    request.state.model = body.model
    adapter = state.adapter(body.model, "completions")
    if body.echo:
        raise ApiError(400, "'echo' is not supported (the prompt is not scored); leave it false and prepend the "
                            "prompt yourself", param="echo")
    if body.suffix:
        raise ApiError(400, "'suffix' is not supported (no fill-in-the-middle); leave it empty", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, f"'best_of' must equal 'n' ({body.n}) or be left out: choices are not ranked server-side",
                       param="best_of")
    ch.check_n(state, body.n)
    stops = check_stops(body.stop)
    prompts = split_prompts(body.prompt)
    payload = sampling_payload(body, ROUTE_FIELDS["completions"])
    grammar = await off_loop_when(body.response_format is not None, response_format_grammar,  # the schema's walk
                                  body.response_format)
    inputs = await unless_disconnected(request, completion_requests(adapter, body.model, payload, prompts, grammar))
    started = time.perf_counter()
    try:
        choices = await ch.start_choices(
            request, state, body.model, adapter, inputs, body.n,
            lambda prompt, i: with_choice(adapter, prompt, body.seed, i, body.logprobs), stops, body.max_tokens,
            started)
    except ApiError as exc:
        if exc.param == "input_ids":  # token-id prompts reach the model as its input_ids: name what the client sent
            exc.param, exc.message = "prompt", exc.message.replace("'input_ids'", "'prompt'")
        raise
    rid = f"cmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    offsets = {c.index: 0 for c in choices}

    def lp(choice: ch.Choice, entries: list[ch.TokenLogprob]) -> dict[str, Any] | None:
        if body.logprobs is None:
            return None
        out, offsets[choice.index] = completion_logprobs(adapter, entries, offsets[choice.index])
        return out

    if not body.stream:
        await ch.run_all(request, choices)
        return OrjsonResponse({
            "id": rid, "object": "text_completion", "created": created, "model": body.model,
            "choices": [{"index": c.index, "text": c.text.text, "logprobs": lp(c, c.logprobs), "finish_reason": c.finish_reason}
                        for c in choices],
            "usage": ch.usage(adapter, choices),
        })

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse({"id": rid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": choice_list, **extra})

    async def chunks():
        async for choice, text, entries, done in ch.events(choices):
            if text or entries or done:
                yield chunk([{"index": choice.index, "text": text, "logprobs": lp(choice, entries),
                              "finish_reason": choice.finish_reason if done else None}])

    usage = (lambda: chunk([], usage=ch.usage(adapter, choices))) if include_usage else None
    return StreamingResponse(ch.sse_body(chunks(), choices, usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
