"""Whisper's decoding rules as one logits processor of the kvcache sampler, a pure function of each row's tokens.

A row's tokens are `[<|startofprev|> prompt...]? <|startoftranscript|> <|lang|>? <|task|>? <|notimestamps|>? text...`.
From them alone the rules know everything (so forks, preemption and replays mask alike):

- a row whose last token is start-of-transcript is a language detection: only language tokens may follow (HF's
  `detect_language` takes the argmax over `lang_to_id`);
- otherwise the generated tokens are those after start-of-transcript and its language / task / no-timestamps tokens,
  and the rules apply in transformers' order: `begin_suppress_tokens` at the first generated token, then
  `suppress_tokens`, then, unless the prompt holds `<|notimestamps|>`, the timestamp rules (`<|notimestamps|>`
  banned; timestamps come in pairs, except the one right before end-of-text; never decreasing; the first token is
  a timestamp of at most `max_initial_timestamp_index`; text is masked when the timestamps' summed probability
  beats the likeliest text token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar_whisper.config import WhisperTokens

NEG = float("-inf")


class WhisperLogitsRules:
    def __init__(self, tokens: WhisperTokens):
        self.tokens = tokens
        self.language_ids = sorted(tokens.languages.values())  # (a list: the module may be built on the meta device)
        self.prompt_specials = {*tokens.languages.values(), *tokens.tasks.values(), tokens.no_timestamps}
        # the suppressed ids as index tensors, made on first use (a Python list indexes through a new tensor every
        # step: ~0.1 ms of a one-row decode step's ~0.26 ms of rules)
        self._ids: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _index(self, name: str, ids: Sequence[int], device: torch.device) -> torch.Tensor:
        index = self._ids.get((name, device))
        if index is None:
            index = self._ids[name, device] = torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)
        return index

    def __call__(self, logits: torch.Tensor, histories: Sequence[Sequence[int]]) -> torch.Tensor:
        out = None
        for row, history in enumerate(histories):
            shape = self.split(history)
            if shape is None:
                continue
            if out is None:
                out = logits.clone()
            if shape == "detect":
                keep = out[row, self.language_ids]
                out[row] = NEG
                out[row, self.language_ids] = keep
                continue
            generated, timestamps = shape
            self.apply(out[row], generated, timestamps)
        return logits if out is None else out

    def split(self, history: Sequence[int]) -> tuple[list[int], bool] | str | None:
        """"detect", or (the generated tokens, whether timestamps are on); None: no transcript started."""
        t = self.tokens
        n = len(history)
        sot = next((i for i in range(n - 1, -1, -1) if history[i] == t.sot), None)
        if sot is None:
            return None
        if sot == n - 1:
            return "detect"
        begin = sot + 1
        timestamps = True
        while begin < n and history[begin] in self.prompt_specials:
            timestamps = timestamps and history[begin] != t.no_timestamps
            begin += 1
        return list(history[begin:]), timestamps

    def apply(self, row: torch.Tensor, generated: list[int], timestamps: bool) -> None:
        """Mask one row's logits in place (`generated`: its tokens after the prompt)."""
        t = self.tokens
        if not generated and t.begin_suppress:
            row.index_fill_(0, self._index("begin_suppress", t.begin_suppress, row.device), NEG)
        if t.suppress:
            row.index_fill_(0, self._index("suppress", t.suppress, row.device), NEG)
        if not timestamps:
            return
        begin = t.timestamp_begin
        row[t.no_timestamps] = NEG
        last_ts = len(generated) >= 1 and generated[-1] >= begin
        before_ts = len(generated) < 2 or generated[-2] >= begin
        if last_ts:
            if before_ts:
                row[begin:] = NEG  # a pair just closed: text (or end) next
            else:
                row[: t.eot] = NEG  # a lone timestamp: its pair or end-of-text next
        seen = [tok for tok in generated if tok >= begin]
        if seen:
            floor = seen[-1] if last_ts and not before_ts else seen[-1] + 1
            row[begin:floor] = NEG
        if not generated:
            row[:begin] = NEG
            row[begin + t.max_initial_timestamp_index + 1 :] = NEG
        logprobs = row.float().log_softmax(-1)
        if logprobs[begin:].logsumexp(-1) > logprobs[:begin].max():
            row[:begin] = NEG
