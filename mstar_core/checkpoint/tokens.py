"""Tokenizing a request's text without holding the interpreter: `tokenizers`' `encode` keeps the GIL for the whole
text (a 12 MB prompt stalled every other request and `/health` for ~10 s, though it ran off the event loop), while
`encode_batch` releases it while the Rust tokenizer works. The ids become a Python list (which needs the GIL again)
only once their count has been checked. A text far longer than the context could hold is first measured by its head
alone (`_PROBE_CHARS_PER_TOKEN` characters a token): when the head is already past the limit so is the whole (a cut
changes at most the word it falls in), and the rest is never tokenized."""

from __future__ import annotations

from typing import Any

from mstar_core.errors import RequestError

#: Shorter texts take the plain call: releasing the GIL costs more than it saves on them.
_RELEASE_FROM_CHARS = 16 * 1024
#: Characters a token covers at most on ordinary text (a probe longer than the context needs, not a bound).
_PROBE_CHARS_PER_TOKEN = 32
#: Tokens the word a probe's cut falls in may be split into beyond what the whole text gives it.
_CUT_SLACK = 8


def _encoding(tokenizer: Any, text: str, add_special_tokens: bool) -> Any:
    if len(text) < _RELEASE_FROM_CHARS or not hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def encode_ids(tokenizer: Any, text: str, *, add_special_tokens: bool, most: int | None = None,
               what: str = "the prompt", param: str | None = None) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...).ids`, the GIL released while a long text is tokenized;
    more than `most` tokens is a RequestError naming `param` (before the ids are materialised)."""
    if most is not None and len(text) > _PROBE_CHARS_PER_TOKEN * (most + _CUT_SLACK):
        cut = _PROBE_CHARS_PER_TOKEN * (most + _CUT_SLACK)
        head = len(_encoding(tokenizer, text[:cut], add_special_tokens))
        if head > most + _CUT_SLACK:
            raise RequestError(f"{what} has more than {most} tokens (its first {cut} of {len(text)} characters "
                               f"alone are {head}); this model takes at most {most}", param=param)
    encoding = _encoding(tokenizer, text, add_special_tokens)
    if most is not None and len(encoding) > most:
        raise RequestError(f"{what} has {len(encoding)} tokens; this model takes at most {most}", param=param)
    return encoding.ids
