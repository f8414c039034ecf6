"""A generic text adapter for any model whose `LoadedModel.extras` carry a `tokenizers.Tokenizer`.

Chat and completions over a tokenizer-bearing autoregressive model need nothing model-specific: the
model's own `prepare` applies its chat template to `messages` (or tokenizes a `prompt`, or takes
`input_ids`), the walk emits `next_token` ids (and `logprob` / `top_logprobs` when asked), and the
tokenizer turns them back into text. The server builds one of these for every loaded model that has
`extras["tokenizer"]` and no registered chat adapter (chat needs `extras["chat_template"]` too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mstar_core.api.requests.adapters import ApiAdapter
from mstar_core.errors import RequestError
from mstar_core.grammar.pieces import piece_bytes
from mstar_core.sampling import sampling_names

#: Sampling fields of an OpenAI body forwarded to the model's `prepare` when the client set them.
SAMPLING_FIELDS = (*sampling_names(without=("logprobs", "stop_token_ids", "stop_sequences")), "ignore_eos")
#: Fields the chat and completions routes handle themselves (or accept and ignore, like `user`).
ROUTE_FIELDS = {
    "chat": {"model", "messages", "stream", "stream_options", "n", "stop", "logprobs", "top_logprobs",
             "response_format", "modalities", "audio", "max_completion_tokens", "user", "tools", "tool_choice",
             "parallel_tool_calls"},
    "completions": {"model", "prompt", "stream", "stream_options", "n", "stop", "logprobs", "echo", "suffix",
                    "best_of", "user", "response_format"},
}
#: The model input each route fills (`chat_inputs`, `completion_inputs` for a text prompt).
ROUTE_INPUT = {"chat": "messages", "completions": "prompt"}


class TokenizerChatAdapter(ApiAdapter):
    """Chat (and completions) for `model`: text in, `next_token` ids out, detokenized with `extras["tokenizer"]`."""

    routes = {"chat", "completions"}

    def __init__(self, model: str, loaded: Any | None = None):
        self.model = model
        self.routes = {"chat", "completions"}
        if loaded is not None:
            self.bind(loaded)

    def bind(self, loaded: Any) -> None:
        self.loaded = loaded
        extras = getattr(loaded, "extras", {}) or {}
        self.tokenizer = extras["tokenizer"]
        self.eos_ids = {int(t) for t in extras.get("eos_token_ids", ()) or ()}
        routes = {"chat", "completions"} if extras.get("chat_template") is not None else {"completions"}
        # a declared request schema says what the model takes: no route whose inputs it would refuse (Orpheus has a
        # tokenizer but takes `text`, not a `prompt`)
        schema = getattr(loaded, "request_schema", None)
        if schema is not None:
            fields = {f.name for f in schema.fields}
            routes = {r for r in routes if ROUTE_INPUT[r] in fields}
        self.routes = routes

    def sampling_inputs(self, body: Mapping[str, Any], route: str = "chat") -> dict[str, Any]:
        """The sampling fields the client set (a 400 for fields neither the route nor sampling knows)."""
        return self._sampling(body, route)

    def _sampling(self, body: Mapping[str, Any], route: str) -> dict[str, Any]:
        unknown = sorted(k for k, v in body.items()
                         if v is not None and k not in ROUTE_FIELDS[route] and k not in SAMPLING_FIELDS)
        if unknown:
            known = sorted(ROUTE_FIELDS[route] | set(SAMPLING_FIELDS))
            raise RequestError(f"unknown field(s) {unknown} for model '{self.model}'; known: {known}", param=unknown[0])
        return {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}

    def chat_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        # OpenAI's newer "developer" role is the system prompt under another name; templates know only "system"
        messages = [{"role": "system" if m["role"] == "developer" else m["role"], "content": _text_of(m.get("content"))}
                    for m in body["messages"]]
        return {"messages": messages, **self._sampling(body, "chat")}

    def completion_inputs(self, body: Mapping[str, Any], prompt: str | list[int]) -> dict[str, Any]:
        key = "prompt" if isinstance(prompt, str) else "input_ids"
        return {key: prompt, **self._sampling(body, "completions")}

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    def is_stop_token(self, token_id: int) -> bool:
        return int(token_id) in self.eos_ids

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        return list(piece_bytes(self.tokenizer, int(token_id)))


def _text_of(content: Any) -> str:
    """Text of a message's content: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text")
