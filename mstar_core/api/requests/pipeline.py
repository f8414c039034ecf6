"""The one pipeline for text and voice requests: what chat, completions, responses, realtime and transcriptions
do between reading their OpenAI request and shaping their response.

1. `sampling_fields` / `sampling_payload`: the sampling fields checked against their one declaration
   (`mstar_core.sampling`), whatever the route calls them.
2. `chat_request`: messages and media to the model's request fields. The response format or the tools become the
   grammar, the tools and past calls are written into the prompt in the model family's format (`ChatTools`), media
   are decoded and bounded, and the adapter's `chat_message_inputs` hook builds the inputs (off the event loop when
   there are media). Realtime and transcriptions hand over turns they decoded themselves.
   `completion_requests` does the same for raw prompts.
3. `start_choices` (in `choices`): `n` choices submitted, each with its own seed (`with_choice`).
4. The answer: `TextAssembler` (stops, EOS, the length limit, whole characters), `ChatTools` or `ToolCalls` for
   the calls in it, streamed as the route's chunks or assembled whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mstar_core.api import media
from mstar_core.api.http.errors import ApiError, from_request_error
from mstar_core.api.requests.chat_tools import ChatTools
from mstar_core.api.requests.formats import prepared_grammar
from mstar_core.api.requests.submit import adapter_call
from mstar_core.errors import RequestError
from mstar_core.grammar.spec import GrammarSpec
from mstar_core.sampling import check_fields, choice_seed


def check_stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "'stop' takes up to 4 non-empty strings", param="stop")
    return stops


def sampling_fields(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The sampling fields a request set (None means unset), checked, under their sampling names. `names` maps a
    route's own name to the sampling one (the Responses API's `max_output_tokens` is `max_tokens`); an error names
    the field as the client sent it."""
    names = names or {}
    out: dict[str, Any] = {}
    for sent, value in values.items():
        if value is None:
            continue
        name = names.get(sent, sent)
        try:
            check_fields({name: value})
        except RequestError as exc:
            raise ApiError(400, str(exc).replace(f"'{name}'", f"'{sent}'"), param=sent) from None
        out[name] = value
    return out


def sampling_payload(body: Any, route_fields: set[str]) -> dict[str, Any]:
    """The body as a dict for the adapter: sampling fields checked (as on every route), vLLM's top_k=-1 as 0."""
    payload = body.model_dump()
    if payload.get("top_k") == -1:
        payload["top_k"] = 0
    check_fields({k: v for k, v in payload.items() if k not in route_fields})
    return payload


def with_choice(adapter: Any, inputs: Mapping[str, Any], seed: int | None, i: int,
                logprobs: int | None) -> dict[str, Any]:
    """Choice `i`'s raw inputs: the shared ones with its own seed (seed + i) and the log-probability request."""
    out = dict(inputs)
    if seed is not None:
        out["seed"] = choice_seed(seed, i)
    if logprobs is not None:
        out.update(adapter.sampling_logprobs(logprobs))
    return out


async def decode_messages(adapter: Any, model: str, messages: list[dict[str, Any]],
                          limits: media.MediaLimits) -> list[media.ChatTurn]:
    """The messages as typed parts for the adapter: media checked against what the model takes, fetched where
    allowed, decoded off the event loop (thousands of text messages take seconds too)."""
    accepts = frozenset(getattr(adapter, "chat_media", ()) or ())
    try:
        fetched = await media.fetch_remote(messages, accepts, model, limits) if media.has_media(messages) else None
        return await asyncio.to_thread(media.decode_messages, messages, accepts, model, limits, fetched)
    except RequestError as exc:
        raise from_request_error(exc) from None


async def request_grammar(adapter: Any, model: str, response_format: GrammarSpec | None, format_param: str,
                          tools: ChatTools | None) -> list[str] | None:
    """The grammar the reply is held to: the response format's, else the tools' (they never go together)."""
    grammar = await prepared_grammar(adapter, model, response_format, format_param)
    if grammar is None and tools is not None:
        grammar = await prepared_grammar(adapter, model, tools.grammar, "tools")
    return grammar


async def chat_request(state: Any, adapter: Any, model: str, payload: dict[str, Any], *,
                       tools: ChatTools | None = None, response_format: GrammarSpec | None = None,
                       format_param: str = "response_format", turns: Sequence[media.ChatTurn] | None = None,
                       call: Callable[..., Any] | None = None) -> dict[str, Any]:
    """A chat turn's model inputs from `payload` (the request's fields, `messages` as OpenAI chat messages).

    The grammar of the response format or the tools is set, the tools written into the messages, the messages'
    media decoded (unless the route decoded its `turns` itself), then the adapter's `chat_message_inputs` builds
    the inputs, off the event loop (an adapter may resample or convert media, or render a long conversation).
    `call` runs the hook (default `adapter_call`: a rejection is a 400 naming the adapter)."""
    payload["grammar"] = await request_grammar(adapter, model, response_format, format_param, tools)
    if tools is not None:
        # offered tools are written into the system prompt as JSON (megabytes for a large description): off the loop
        offered = tools.active and bool(tools.tools)
        payload["messages"] = (await asyncio.to_thread(tools.messages, payload["messages"]) if offered
                               else tools.messages(payload["messages"]))
    if turns is None:
        turns = await decode_messages(adapter, model, payload["messages"],
                                      state.media_limits[(state.base_model(model), "chat")])
    call = call or (lambda fn, *args: adapter_call(fn, *args, what=f"the chat adapter of '{model}'"))
    return await asyncio.to_thread(call, adapter.chat_message_inputs, payload, list(turns))


async def completion_requests(adapter: Any, model: str, payload: dict[str, Any], prompts: Sequence[Any],
                              response_format: GrammarSpec | None) -> list[dict[str, Any]]:
    """Each raw prompt's model inputs (all built, and so checked, before anything is submitted)."""
    payload["grammar"] = await request_grammar(adapter, model, response_format, "response_format", None)
    what = f"the completions adapter of '{model}'"
    return [adapter_call(adapter.completion_inputs, payload, p, what=what) for p in prompts]
