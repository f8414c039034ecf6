"""Turn a request (`messages`, `prompt` or `input_ids`, plus sampling fields) into the `prefill` walk's env.

The fields, their types and bounds are declared once in `request_schema`; the runtime checks a request against
it before `RequestPreparer` sees it. What is left here depends on the loaded model: the vocabulary, the context
length and the chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mstar_core.checkpoint.tokens import encode_ids
from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingDefaults, SamplingParams, fit_max_tokens
from mstar_core.schema import RequestField, RequestSchema, sampling_field
from mstar_llm.chat import check_messages, render_chat

PROMPT_KEYS = ("messages", "prompt", "input_ids")
SAMPLING_KEYS = tuple(f.name for f in attrs.fields(SamplingParams))
#: Most choices one request may ask for.
MAX_N = 128
EXAMPLE = {"prompt": "The capital of France is", "max_tokens": 8}


def request_schema(vocab_size: int, max_model_len: int) -> RequestSchema:
    """The request fields of a causal LM with this vocabulary and context."""

    def in_vocab(ids: list[int], name: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"'{name}' has ids {bad[:5]} outside the vocabulary [0, {vocab_size})", param=name)
        return ids

    return RequestSchema(
        fields=(
            RequestField("messages", "array", "chat messages [{role, content}], through the model's chat template",
                         min_length=1, items="object", check=lambda v, _name: check_messages(v)),
            RequestField("prompt", "string", "text to continue (tokenized with BOS)", min_length=1),
            RequestField("input_ids", "array", "token ids to continue", min_length=1, max_length=max_model_len - 1,
                         items="integer", check=in_vocab),
            *(sampling_field(name) for name in SAMPLING_KEYS),
            RequestField("ignore_eos", "boolean", "keep generating past the end-of-sequence token", default=False),
            RequestField("n", "integer", "choices sampled from one prefill of the prompt (forks of its cache), "
                         "choice i with seed + i; each emitted value carries its choice as `Output.branch`",
                         minimum=1, maximum=MAX_N),
        ),
        exactly_one_of=(PROMPT_KEYS,),
        draws_n=True,
        example=EXAMPLE,
        description="a causal LM: one prompt, sampling fields; streams `next_token` (and logprobs when asked)",
    )


@attrs.define
class RequestPreparer:
    """`prepare(inputs)` for a causal LM: tokenizes, applies the chat template, builds `SamplingParams`.

    Takes inputs already checked by `request_schema`. EOS ids always stop generation (unless
    `ignore_eos`), in addition to any `stop_token_ids`.
    """

    tokenizer: Any
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_model_len: int
    special_tokens: Mapping[str, str] = attrs.field(factory=dict)
    #: the checkpoint's sampling defaults (`generation_config.json`), for fields a request leaves unset
    sampling_defaults: SamplingDefaults = attrs.field(factory=SamplingDefaults)

    @property
    def schema(self) -> RequestSchema:
        return request_schema(self.vocab_size, self.max_model_len)

    def __call__(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        key = next(k for k in PROMPT_KEYS if inputs.get(k) is not None)
        ids = self._ids(key, inputs[key])
        if len(ids) + 1 > self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model takes at most {self.max_model_len - 1}",
                               param=key)
        fields = {k: inputs[k] for k in SAMPLING_KEYS if inputs.get(k) is not None}
        if not inputs.get("ignore_eos", False):
            user_stops = fields.get("stop_token_ids", ())
            user_stops = [user_stops] if isinstance(user_stops, int) else list(user_stops)
            fields["stop_token_ids"] = list(dict.fromkeys([*user_stops, *self.eos_token_ids]))
        # the model's defaults under what the request set; then what cannot fit is capped up front (the one clamp,
        # `fit_max_tokens`), never discovered after generating up to the context's end and then refused
        fields = self.sampling_defaults.merged(fields)
        fields["max_tokens"] = fit_max_tokens(fields.get("max_tokens"), len(ids), self.max_model_len)
        env = {"input_ids": ids, "sampling": SamplingParams.from_mapping(fields).check_vocab(self.vocab_size)}
        n = inputs.get("n")
        if n is not None:  # choices as forks of one prefill (see `choice_walks`)
            env.update(n=n, prompt_head=ids[:-1], prompt_tail=ids[-1:], fork_label="main" if len(ids) > 1 else None)
            if len(ids) == 1:
                del env["prompt_head"]
        return env

    def _ids(self, key: str, value: Any) -> list[int]:
        if key == "input_ids":
            return list(value)
        if key == "prompt":
            return self._encode(value, True, key)
        if self.chat_template is None:
            raise RequestError("this model has no chat template; send 'prompt' or 'input_ids' instead of 'messages'",
                               param="messages")
        text = render_chat(self.chat_template, check_messages(value), **self.special_tokens)
        # the template already wrote every special token; adding BOS again would double it
        return self._encode(text, False, key)

    def _encode(self, text: str, add_special_tokens: bool, key: str) -> list[int]:
        # the GIL released while a long text is tokenized; one past the context refused before its ids are built
        return encode_ids(self.tokenizer, text, add_special_tokens=add_special_tokens, most=self.max_model_len - 1,
                          param=key)
