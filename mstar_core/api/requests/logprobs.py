"""Log-probabilities in OpenAI's two shapes: chat's per-token objects (text, bytes, alternatives) and the legacy
completions object (parallel lists of tokens, log-probabilities, alternatives and text offsets)."""

from __future__ import annotations

from typing import Any

from mstar_core.api.requests.choices import TokenLogprob


def _entry(adapter: Any, token: int, logprob: float | None) -> dict[str, Any]:
    return {"token": adapter.token_text(token), "logprob": logprob, "bytes": adapter.token_bytes(token)}


def chat_logprobs(adapter: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion (or chunk): `{"content": [...], "refusal": None}`."""
    content = []
    for token, logprob, top in entries:
        item = _entry(adapter, token, logprob)
        item["top_logprobs"] = [_entry(adapter, t, lp) for t, lp in (top or ())]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(adapter: Any, entries: list[TokenLogprob], offset: int = 0) -> tuple[dict[str, Any], int]:
    """`choices[i].logprobs` of a legacy completion, and the text offset after these tokens.

    `text_offset[k]` is where token k's text starts in the choice's text (counted in characters of
    the tokens' own texts, as vLLM counts them), starting at `offset`.
    """
    tokens, logprobs, tops, offsets = [], [], [], []
    for token, logprob, top in entries:
        text = adapter.token_text(token)
        tokens.append(text)
        logprobs.append(logprob)
        # the chosen token is among its alternatives (as vLLM answers; with `logprobs: 0` it is all there is)
        alternatives = {adapter.token_text(t): lp for t, lp in (top or ())}
        alternatives.setdefault(text, logprob)
        tops.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}, offset
