"""Turn a request (`messages`, `prompt` or `input_ids`, plus sampling fields) into the `prefill` walk's env."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams
from mstar_llm.chat import check_messages, render_chat

PROMPT_KEYS = ("messages", "prompt", "input_ids")
SAMPLING_KEYS = tuple(f.name for f in attrs.fields(SamplingParams))
EXTRA_KEYS = ("ignore_eos",)


@attrs.define
class RequestPreparer:
    """`prepare(inputs)` for a causal LM: tokenizes, applies the chat template, builds `SamplingParams`.

    EOS ids always stop generation (unless `ignore_eos`), in addition to any `stop_token_ids`.
    """

    tokenizer: Any
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_model_len: int
    special_tokens: Mapping[str, str] = attrs.field(factory=dict)

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(inputs, Mapping):
            raise RequestError(f"request inputs must be an object, got {type(inputs).__name__}")
        unknown = sorted(set(inputs) - set(PROMPT_KEYS) - set(SAMPLING_KEYS) - set(EXTRA_KEYS))
        if unknown:
            raise RequestError(
                f"unknown field(s) {unknown}; send one of {list(PROMPT_KEYS)} plus sampling fields {list(SAMPLING_KEYS)}"
            )
        given = [k for k in PROMPT_KEYS if k in inputs]
        if len(given) != 1:
            raise RequestError(f"send exactly one of {list(PROMPT_KEYS)}, got {given or 'none'}")
        ids = self._ids(given[0], inputs[given[0]])
        sampling = self._sampling(inputs)
        if len(ids) + 1 > self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model takes at most {self.max_model_len - 1}",
                               param=given[0])
        return {"input_ids": ids, "sampling": sampling}

    def _ids(self, key: str, value: Any) -> list[int]:
        if key == "input_ids":
            if isinstance(value, str) or not isinstance(value, Sequence) or not value:
                raise RequestError("'input_ids' must be a non-empty list of token ids", param="input_ids")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise RequestError("'input_ids' must contain only integers", param="input_ids")
            bad = [t for t in value if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"'input_ids' has ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                                   param="input_ids")
            return list(value)
        if key == "prompt":
            if not isinstance(value, str) or not value:
                raise RequestError("'prompt' must be a non-empty string", param="prompt")
            return self.tokenizer.encode(value, add_special_tokens=True).ids
        if self.chat_template is None:
            raise RequestError("this model has no chat template; send 'prompt' or 'input_ids' instead of 'messages'")
        text = render_chat(self.chat_template, check_messages(value), **self.special_tokens)
        # the template already wrote every special token; adding BOS again would double it
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _sampling(self, inputs: Mapping[str, Any]) -> SamplingParams:
        fields = {k: inputs[k] for k in SAMPLING_KEYS if k in inputs and inputs[k] is not None}
        ignore_eos = inputs.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"'ignore_eos' must be true or false, got {ignore_eos!r}", param="ignore_eos")
        if not ignore_eos:
            user_stops = fields.get("stop_token_ids", ())
            user_stops = [user_stops] if isinstance(user_stops, int) else list(user_stops)
            fields["stop_token_ids"] = list(dict.fromkeys([*user_stops, *self.eos_token_ids]))
        return SamplingParams.from_mapping(fields).check_vocab(self.vocab_size)
