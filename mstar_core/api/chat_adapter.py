"""A generic chat adapter for any model whose `LoadedModel.extras` carry a `tokenizers.Tokenizer`.

Chat over a tokenizer-bearing autoregressive model needs nothing model-specific: the model's own
`prepare` applies its chat template to `messages`, the walk emits `next_token` ids, and the
tokenizer turns them back into text. The server builds one of these for every loaded model that has
`extras["tokenizer"]` and no registered chat adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mstar_core.api.adapters import ApiAdapter

#: Sampling fields of an OpenAI chat body forwarded to the model's `prepare` when the client set them.
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty")


class TokenizerChatAdapter(ApiAdapter):
    """Chat for `model`: messages in, `next_token` ids out, detokenized with `extras["tokenizer"]`."""

    routes = {"chat"}

    def __init__(self, model: str, loaded: Any | None = None):
        self.model = model
        self.routes = {"chat"}
        if loaded is not None:
            self.bind(loaded)

    def bind(self, loaded: Any) -> None:
        self.loaded = loaded
        extras = getattr(loaded, "extras", {}) or {}
        self.tokenizer = extras["tokenizer"]
        self.eos_ids = {int(t) for t in extras.get("eos_token_ids", ()) or ()}

    def chat_inputs(self, body: Mapping[str, Any]) -> dict[str, Any]:
        # OpenAI's newer "developer" role is the system prompt under another name; templates know only "system"
        messages = [{"role": "system" if m["role"] == "developer" else m["role"], "content": _text_of(m.get("content"))}
                    for m in body["messages"]]
        inputs: dict[str, Any] = {"messages": messages}
        for name in SAMPLING_FIELDS:
            if body.get(name) is not None:
                inputs[name] = body[name]
        return inputs

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    def is_stop_token(self, token_id: int) -> bool:
        return int(token_id) in self.eos_ids


def _text_of(content: Any) -> str:
    """Text of a message's content: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text")
