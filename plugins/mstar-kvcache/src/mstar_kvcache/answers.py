"""Answers of a `KVCacheEngine`'s calls: per-token rows and/or sampled tokens, finish reasons, failures, what attaches next."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import attrs
import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Result
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.grammar import attach as attach_grammars
from mstar_kvcache.history import TokenIds
from mstar_kvcache.intake import CallIntake
from mstar_kvcache.labels import Labels
from mstar_kvcache.no_token import NoTokenColumns
from mstar_kvcache.readers import ReadOnlyCalls
from mstar_kvcache.rows import CallRows
from mstar_kvcache.sampler import Sampled
from mstar_kvcache.sampler import sample as sample_rows
from mstar_kvcache.sequence import Sequence


def penalty_history(seq: Sequence) -> list[int] | torch.Tensor:
    """What the repetition penalty reads: the tokens, mirrored as a tensor when the row has a penalty."""
    if seq.sampling is None or seq.sampling.repetition_penalty == 1.0:
        return seq.tokens
    if seq.token_ids is None:
        seq.token_ids = TokenIds()
    return seq.token_ids.of(seq.tokens)


class CallAnswers:
    """Turns a step's hidden states into each finished call's result: its rows and `compute_<name>` outputs, or
    its sampled token (a `decode_steps` call fed back until done); fails calls; attaches what waits behind them.

    `module` is what `compute_logits` / `compute_<name>` are called on (a split node's rank 0: on every rank).
    """

    def __init__(self, node: str, module: Any, outputs: Collection[str], rows: CallRows, no_token: NoTokenColumns | None,
                 grammar_vocab: Any, max_model_len: int | None, labels: Labels, readonly: ReadOnlyCalls,
                 intake: CallIntake, blocks: BlockManager):
        self.node, self.module, self.rows = node, module, rows
        self.returns_logits, self.returns_hidden = "logits" in outputs, "hidden" in outputs
        self.returns_logprobs = "logprob" in outputs  # (a log-softmax over the vocabulary, when a request asks)
        self.no_token = no_token  # vocabulary columns no token stands for (padding): never sampled
        self.grammar_vocab = grammar_vocab  # what sampling grammars compile against
        self.max_model_len = max_model_len
        self.labels, self.readonly, self.intake, self.blocks = labels, readonly, intake, blocks
        # a module's own logits rules (`process_logits(logits, histories)`, e.g. Whisper's timestamp rules): a pure
        # function of each row's tokens so far, so forks, preemption and replays see the same masks
        self.process_logits = getattr(module, "process_logits", None)

    def _per_token(self, rows: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Each call's `compute_<name>` outputs over its rows (one module call per output for all of them)."""
        if not rows:
            return []
        with torch.inference_mode():
            joined = torch.cat(rows)
            sizes = [r.shape[0] for r in rows]
            computed = {name: getattr(self.module, f"compute_{name}")(joined).split(sizes)
                        for name in self.rows.extra_outputs}
        return [{name: values[i] for name, values in computed.items()} for i in range(len(rows))]

    def finish_rows(self, done: list[tuple[Sequence, int]]) -> list[Result]:
        """Per-token outputs: the calls' rows of hidden states and the module's outputs computed from them."""
        rows = [self.rows.take(seq) for seq, _ in done]
        try:
            computed = self._per_token(rows)
        except Exception as exc:
            return [self.fail(seq, exc) for seq, _ in done]
        results = []
        for i, (seq, _) in enumerate(done):
            out: dict[str, Any] = dict(computed[i])
            if self.returns_hidden:
                out["hidden"] = rows[i]
            results.append(self._complete(seq, out))
        return results

    def reads_hidden_later(self, work: list[tuple[Sequence, int]]) -> bool:
        """Whether a step's hidden rows are read after the step's answers (returned, or gathered over several steps):
        if not, a replayed step may hand out its own buffer, which the next step overwrites."""
        return (self.returns_hidden or not self.rows.samples or bool(self.rows.extra_outputs)
                or any(seq.gathers or seq.speculation is not None and seq.speculation.drafts for seq, _ in work))

    def rows_read(self, work: list[tuple[Sequence, int]]) -> list[int] | None:
        """The only rows of a step's hidden states its answers read, where nothing reads them later
        (`reads_hidden_later` false, which the caller checks): the last row of each call the step completes (a
        decode row, or a prompt's final chunk); None where those are every row (a decode step). A prompt chunk that
        does not end its prompt has no row read at all."""
        rows, row = [], 0
        for seq, n in work:
            row += n
            if seq.pending is not None and seq.remaining == n:  # (the engine answers it after this step)
                rows.append(row - 1)
        if not rows:  # (nothing read: one row keeps the last layer's shapes non-empty)
            rows.append(row - 1)
        return None if len(rows) == row else rows

    def takes_argmax(self, work: list[tuple[Sequence, int]]) -> bool:
        """Whether every row of a step will be its logits' argmax as the head wrote them (greedy, nothing adjusting
        or masking the logits, no log-probabilities): a replayed step may then pick the tokens with its head."""
        if self.no_token is not None or self.process_logits is not None:
            return False
        for seq, _ in work:
            params = seq.sampling
            if seq.grammar is not None or params is not None and (
                    not params.greedy or params.logprobs is not None or params.adjusts_logits
                    or params.grammar is not None):
                return False
        return True

    def finish(self, done: list[tuple[Sequence, int]], hidden: torch.Tensor,
               step_logits: torch.Tensor | None = None, step_tokens: torch.Tensor | None = None) -> list[Result]:
        """Sampled outputs of the calls in `done` (each with its row of `hidden`); a `decode_steps` call going on
        gives none. `step_logits`: the logits of every row of `hidden`, where the step computed them (a replay that
        ran the LM head: a buffer the next step overwrites); `step_tokens`: each row's argmax over them, where the
        step picked those too (`takes_argmax`)."""
        # per-token outputs of the calls that asked, computed before sampling (a failure there fails them alone)
        asked = [(s, r) for s, r in done if s.collected]
        extras: dict[int, dict[str, torch.Tensor]] = {}
        if asked:
            try:
                extras = dict(zip((id(s) for s, _ in asked), self._per_token([self.rows.take(s) for s, _ in asked]),
                                  strict=True))
            except Exception as exc:
                failed = [self.fail(s, exc) for s, _ in asked]
                rest = [(s, r) for s, r in done if not any(s is a for a, _ in asked)]
                return failed + (self.finish(rest, hidden, step_logits) if rest else [])
        rows = [r for _, r in done]
        # every row of the step, in order (a decode step): the rows themselves, no index tensor and copy
        logits, tokens = step_logits, None if step_logits is None else step_tokens
        if rows == list(range(hidden.shape[0])):
            last = hidden
        else:
            index = torch.tensor(rows, device=hidden.device)
            last = hidden[index]
            logits = None if logits is None else logits[index]
            tokens = None if tokens is None else tokens[index]
        if logits is not None and self.returns_logits:  # (answered as they are: a copy the next step keeps off)
            logits = logits.clone()
        seqs = [s for s, _ in done]
        try:
            logits, picked = self.sample(seqs, last, logits, tokens)
        except Exception:
            # One row's parameters broke the batched sampling: sample each row alone so only it fails.
            # (The sampler draws last, so no row's generator advanced before the failure.)
            answers = [self._finish_alone(seq, last[i : i + 1], extras.get(id(seq))) for i, seq in enumerate(seqs)]
        else:
            answers = [self._answer(seq, i, logits, picked, last, extras.get(id(seq)) if extras else None)
                       for i, seq in enumerate(seqs)]
        return [a for a in answers if a is not None]  # None: a decode_steps call goes on

    def _finish_alone(self, seq: Sequence, last: torch.Tensor, extras: dict[str, torch.Tensor] | None) -> Result | None:
        try:
            logits, picked = self.sample([seq], last)
        except Exception as exc:
            return self.fail(seq, exc)
        return self._answer(seq, 0, logits, picked, last, extras)

    def sample(self, seqs: list[Sequence], last: torch.Tensor, logits: torch.Tensor | None = None,
               argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, Sampled]:
        """The logits of `last` (one row per sequence; `logits`: already computed, `argmax`: their rows' argmax, as
        computed with them) and the tokens drawn from them."""
        with torch.inference_mode():
            if logits is None:
                logits = self.module.compute_logits(last)
            if self.no_token is not None:  # ids no token stands for (a padded vocabulary) are never drawn
                self.no_token.fill(logits)
            if self.process_logits is not None:
                logits = self.process_logits(logits, [s.tokens for s in seqs])
            # a log-softmax normaliser over the vocabulary per row: only when a request asked for it
            wanted = self.returns_logprobs and any(s.sampling and s.sampling.logprobs is not None for s in seqs)
            grammars = None
            if any(s.sampling is not None and s.sampling.grammar is not None or s.grammar is not None for s in seqs):
                grammars = attach_grammars(self.node, self.grammar_vocab, seqs)
            if argmax is not None and (self.no_token is not None or self.process_logits is not None):
                argmax = None  # (taken before the logits were masked)
            picked = sample_rows(logits, [s.sampling for s in seqs], [s.generator for s in seqs],
                                 [penalty_history(s) for s in seqs], logprobs=wanted,
                                 generated=[s.generated for s in seqs], grammars=grammars, argmax=argmax)
        return logits, picked

    def _answer(self, seq: Sequence, i: int, logits: torch.Tensor, picked: Sampled, last: torch.Tensor,
                extras: dict[str, torch.Tensor] | None = None) -> Result | None:
        """Row `i`'s outputs (and the call's per-token `extras`); the call is done, the label's next queued call attaches.

        None when the call has `decode_steps` left: the token was fed back and the call stays pending.
        """
        token = picked.tokens[i]
        if seq.grammar is not None and seq.grammar.rejected:
            return self.fail(seq, RequestError(f"node '{self.node}': no token fits the request's grammar here "
                                               "(the model's vocabulary cannot continue it)"))
        # a call without sampling is a prompt write: its token is returned but never one the label generated
        # (max_tokens, stops, penalties and the grammar count only the tokens a sampling call drew)
        keep = not seq.readonly and seq.call.sampling is not None
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
            return self.fail(seq, exc)
        if seq.call.decode_steps is not None:
            if self._step_again(seq, token, out["finish_reason"]):
                return None
            out["next_token"], seq.stepped = seq.stepped, []
        if picked.logprobs[i] is not None:
            out["logprob"] = picked.logprobs[i]
        if picked.top_logprobs[i] is not None:
            out["top_logprobs"] = picked.top_logprobs[i]
        if self.returns_logits:
            out["logits"] = logits[i]
        if self.returns_hidden:
            out["hidden"] = last[i]
        if extras:
            out.update(extras)
        return self._complete(seq, out)

    def _step_again(self, seq: Sequence, token: int, finish_reason: str | None) -> bool:
        """Feed a `decode_steps` call's token back as its next input, unless it has all its tokens or a finish reason.

        The continuation runs in the engine's next step beside whatever else is scheduled, with no
        round trip through the walk; its outputs other than `next_token` are those of its last token.
        """
        seq.stepped.append(token)
        start = len(seq.tokens)
        if (finish_reason is not None or len(seq.stepped) >= seq.call.decode_steps
                or (self.max_model_len is not None and start + 1 > self.max_model_len)):
            return False
        # the token as a one-id call of its own: implicit next position, routing 0, causal (only a sequence that
        # records positions or routing has anything to record for it, as in `CallIntake.attach`)
        if seq.positions is not None or seq.routing is not None:
            self.intake.append_inputs(seq, attrs.evolve(seq.call, ids=[token], embeds=[], positions=None,
                                                        routing=None, extras={}), start)
        if seq.limits is not None:
            seq.limits.append(start + 1)
        seq.tokens.append(token)
        seq.chunkable = True
        return True

    def _complete(self, seq: Sequence, out: dict[str, Any]) -> Result:
        """Answer the sequence's call with `out`; run its after-call label operations; attach what waits."""
        inv, call = seq.pending, seq.call
        seq.pending, seq.call, seq.gathers = None, None, False
        if seq.readonly:
            self.readonly.drop(seq)
        try:
            for name in () if seq.readonly else call.snapshot_after:
                self.labels.snapshot_label(seq.request_id, seq.label, name)
            for name in call.drop:
                self.labels.drop_label(seq.request_id, name)
        except Exception as exc:
            if not seq.readonly:
                self.intake.attach_backlog(seq)
            return (inv, exc)
        if seq.readonly:
            return (inv, out)
        self.intake.attach_backlog(seq)
        return (inv, out)

    def complete(self, seq: Sequence, out: dict[str, Any]) -> Result:
        """Answer the sequence's call with `out` (for a verified speculative step: `speculative.py`)."""
        return self._complete(seq, out)

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why the label stops after `token` (its stop tokens and sequences, its grammar, max_tokens), or None."""
        return self._finish_reason(seq, token)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if params is None:
            return None
        if token in params.stop_token_ids:
            return "stop"
        if seq.grammar is not None and seq.grammar.finished:  # (its stop token taken though not a request stop)
            return "stop"
        for stop in params.stop_sequences:
            if len(seq.generated) >= len(stop) and tuple(seq.generated[-len(stop) :]) == stop:
                return "stop"
        if len(seq.generated) >= params.max_tokens:
            return "length"
        return None

    def fail(self, seq: Sequence, exc: BaseException) -> Result:
        """Answer the sequence's call with `exc`: its tokens roll back, the label's next queued call attaches."""
        inv = seq.pending
        seq.pending, seq.call, seq.collected, seq.gathers = None, None, [], False
        if seq.stepped:  # a decode_steps call failing midway: its tokens go with it
            del seq.generated[len(seq.generated) - len(seq.stepped):]
            seq.stepped = []
        if seq.readonly:
            self.readonly.drop(seq)
            return (inv, exc)
        self.blocks.truncate(seq, seq.pending_start)
        self.intake.attach_backlog(seq)
        return (inv, exc)
