"""Answers of `KVCacheEngine` calls: per-token rows or sampled tokens, finish reasons, failures, what attaches next."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.runtime.engine import Result
from mstar_kvcache.sampler import Sampled, sample
from mstar_kvcache.sequence import Sequence


class CallAnswers:
    """Mixin of `KVCacheEngine`: turns a step's hidden states into each finished call's result."""

    def _finish_rows(self, done: list[tuple[Sequence, int]]) -> list[Result]:
        """Per-token outputs: the calls' rows of hidden states and the module's outputs computed from them."""
        rows = []
        for seq, _ in done:
            got = torch.cat(seq.collected) if len(seq.collected) > 1 else seq.collected[0]
            call = seq.call
            if call.output_index is not None:
                got = got[call.output_index.to(got.device)]
            elif call.output_rows == "last":
                got = got[-1:]
            rows.append(got)
            seq.collected = []
        computed: dict[str, list[torch.Tensor]] = {}
        try:
            with torch.inference_mode():
                joined = torch.cat(rows)
                for name in self.extra_outputs:
                    computed[name] = list(getattr(self.module, f"compute_{name}")(joined).split([r.shape[0] for r in rows]))
        except Exception as exc:
            return [self._fail(seq, exc) for seq, _ in done]
        results = []
        for i, (seq, _) in enumerate(done):
            out: dict[str, Any] = {}
            if "hidden" in self.node.outputs:
                out["hidden"] = rows[i]
            for name, values in computed.items():
                out[name] = values[i]
            results.append(self._complete(seq, out))
        return results

    def _finish(self, done: list[tuple[Sequence, int]], hidden: torch.Tensor) -> list[Result]:
        last = hidden[torch.tensor([r for _, r in done], device=hidden.device)]
        seqs = [s for s, _ in done]
        try:
            logits, picked = self._sample(seqs, last)
        except Exception:
            # One row's parameters broke the batched sampling: sample each row alone so only it fails.
            # (The sampler draws last, so no row's generator advanced before the failure.)
            return [self._finish_alone(seq, last[i : i + 1]) for i, seq in enumerate(seqs)]
        return [self._answer(seq, i, logits, picked, last) for i, seq in enumerate(seqs)]

    def _finish_alone(self, seq: Sequence, last: torch.Tensor) -> Result:
        try:
            logits, picked = self._sample([seq], last)
        except Exception as exc:
            return self._fail(seq, exc)
        return self._answer(seq, 0, logits, picked, last)

    def _sample(self, seqs: list[Sequence], last: torch.Tensor) -> tuple[torch.Tensor, Sampled]:
        with torch.inference_mode():
            logits = self.module.compute_logits(last)
            # a log-softmax normaliser over the vocabulary per row: only when a request asked for it
            wanted = "logprob" in self.node.outputs and any(s.sampling and s.sampling.logprobs is not None for s in seqs)
            picked = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs], [s.tokens for s in seqs],
                            logprobs=wanted, generated=[s.generated for s in seqs])
        return logits, picked

    def _answer(self, seq: Sequence, i: int, logits: torch.Tensor, picked: Sampled, last: torch.Tensor) -> Result:
        """Row `i`'s outputs; the call is done, and the label's next queued call (if any) attaches."""
        token = picked.tokens[i]
        keep = not seq.readonly
        if keep:
            seq.generated.append(token)
        try:
            out: dict[str, Any] = {
                "next_token": token,
                "finish_reason": self._finish_reason(seq, token),
            }
        except Exception as exc:  # e.g. stop lists no validation vetted: this request alone fails
            if keep:
                seq.generated.pop()
            return self._fail(seq, exc)
        if picked.logprobs[i] is not None:
            out["logprob"] = picked.logprobs[i]
        if picked.top_logprobs[i] is not None:
            out["top_logprobs"] = picked.top_logprobs[i]
        if "logits" in self.node.outputs:
            out["logits"] = logits[i]
        if "hidden" in self.node.outputs:
            out["hidden"] = last[i]
        return self._complete(seq, out)

    def _complete(self, seq: Sequence, out: dict[str, Any]) -> Result:
        """Answer the sequence's call with `out`; run its after-call label operations; attach what waits."""
        inv, call = seq.pending, seq.call
        seq.pending, seq.call = None, None
        if seq.readonly:
            self._drop_reader(seq)
        try:
            for name in () if seq.readonly else call.snapshot_after:
                self.snapshot_label(seq.request_id, seq.label, name)
            for name in call.drop:
                self.drop_label(seq.request_id, name)
        except Exception as exc:
            if not seq.readonly:
                self._attach_backlog(seq)
            return (inv, exc)
        if seq.readonly:
            return (inv, out)
        self._attach_backlog(seq)
        return (inv, out)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if params is None:
            return None
        if token in params.stop_token_ids:
            return "stop"
        for stop in params.stop_sequences:
            if len(seq.generated) >= len(stop) and tuple(seq.generated[-len(stop) :]) == stop:
                return "stop"
        if len(seq.generated) >= params.max_tokens:
            return "length"
        return None

    def _fail(self, seq: Sequence, exc: BaseException) -> Result:
        inv = seq.pending
        seq.pending, seq.call, seq.collected = None, None, []
        if seq.readonly:
            self._drop_reader(seq)
            return (inv, exc)
        self.blocks.truncate(seq, seq.pending_start)
        self._attach_backlog(seq)
        return (inv, exc)

    def _attach_backlog(self, seq: Sequence) -> None:
        for inv in list(self.backlog):
            if inv.request_id == seq.request_id and inv.options.get("cache_label", "main") == seq.label:
                self.backlog.remove(inv)
                try:
                    parsed = self._parse(inv)
                    self._attach(self.seqs.get(seq.key) or self._sequence(inv, parsed), inv, parsed)
                except Exception as exc:
                    self.answered.append((inv, exc))
                    continue
                return
