"""Incremental detokenization for the text routes: stop strings, EOS, max_tokens, and no half characters on the wire.

`max_tokens` here is a stop rule (the reply ends "length" at the limit the request was given), not a clamp: fitting
it to the context is `mstar_core.sampling.fit_max_tokens`, once, where the request is prepared."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


class IncrementalText:
    """The text of a growing sequence of generated ids, decoding a short window per id instead of them all.

    Decoding every id again at each step costs time in proportion to the reply so far (a 2,000-token reply decoded
    ~2 million ids on the event loop). Here each step decodes the ids since the text last settled, after the chunk
    that settled before them as context (so a tokenizer that joins pieces by their neighbours, a leading-space
    marker for one, reads them as in the whole sequence), and takes what follows that context's own text. Text
    settles when it ends on a whole character; a window that would change settled text (a tokenizer that
    re-segments across ids) falls back to one full decode.
    """

    def __init__(self, detokenize: Callable[[Sequence[int]], str]):
        self._detokenize = detokenize
        self.ids: list[int] = []
        self._settled = ""  # the text of ids[:_end]: it ended on a whole character
        self._start = 0  # the window's first id: the chunk that settled last, as context
        self._end = 0
        self._context: str | None = ""  # the text of ids[_start:_end] (None: not decoded yet)

    def append(self, token_id: int) -> str:
        """Add one id; the whole text so far (with any incomplete character at its end as U+FFFD)."""
        ids = self.ids
        ids.append(token_id)
        if self._context is None:
            self._context = self._detokenize(ids[self._start:self._end])
        window = self._detokenize(ids[self._start:])
        if window.startswith(self._context):
            fresh = window[len(self._context):]
            if fresh.endswith("\ufffd"):
                return self._settled + fresh
            text = self._settled + fresh
        else:
            text = self._detokenize(ids)
            if text.endswith("\ufffd"):
                return text
        self._settled = text
        self._start, self._end, self._context = self._end, len(ids), None
        return text


class TextAssembler:
    """Feeds generated ids one at a time; returns the text that is safe to send now.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or could still grow
    into a stop string, so a client never sees a stop string or a broken character.

    With `ignore_eos` (the request's field) the model's end token ends nothing here either: the engine keeps
    generating past it, so it is counted like any token (its text is empty: it is special) and the reply runs on.
    """

    def __init__(self, adapter: Any, stops: Sequence[str] = (), max_tokens: int | None = None,
                 ignore_eos: bool = False):
        self.adapter = adapter
        self.stops = [s for s in stops if s]
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self._decoded = IncrementalText(adapter.detokenize)
        self.ids = self._decoded.ids
        self.generated = 0
        self.sent = ""
        self.text = ""
        self.finish_reason: str | None = None

    def feed(self, token_id: int) -> str:
        """Take one generated id; return newly final text (possibly empty)."""
        if self.finish_reason is not None:
            return ""
        self.generated += 1
        if not self.ignore_eos and self.adapter.is_stop_token(token_id):
            self.finish_reason = "stop"
            return self._flush()
        self.text = self._decoded.append(token_id)
        for stop in self.stops:
            at = self.text.find(stop)
            if at != -1:
                self.text = self.text[:at]
                self.finish_reason = "stop"
                return self._flush()
        if self.max_tokens is not None and self.generated >= self.max_tokens:
            self.finish_reason = "length"
            return self._flush()
        return self._release(self._holdback())

    def close(self, env: Mapping[str, Any]) -> str:
        """The generation ended on the model's side; settle finish_reason and return the remaining text."""
        if self.finish_reason is None:
            reason = env.get("finish_reason") if env else None
            if isinstance(reason, list):  # accumulated per step
                reason = next((r for r in reversed(reason) if r), None)
            if reason not in ("stop", "length"):
                at_limit = self.max_tokens is not None and self.generated >= self.max_tokens
                reason = "length" if at_limit else "stop"
            self.finish_reason = reason
        return self._flush()

    def _holdback(self) -> int:
        text = self.text
        hold = 0
        if text.endswith("\ufffd"):
            hold = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _release(self, hold: int) -> str:
        upto = len(self.text) - hold
        if upto <= len(self.sent) or not self.text.startswith(self.sent):
            return ""
        delta = self.text[len(self.sent):upto]
        self.sent = self.text[:upto]
        return delta

    def _flush(self) -> str:
        if not self.text.startswith(self.sent):  # detokenization re-segmented earlier text; send nothing odd
            return ""
        delta = self.text[len(self.sent):]
        self.sent = self.text
        return delta
