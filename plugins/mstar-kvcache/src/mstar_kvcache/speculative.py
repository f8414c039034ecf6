"""Speculative decoding on the shared engine: guessed tokens verified in one forward over the paged cache.

A decode call feeds one token `t` and wants the next. With speculation the engine appends `k` guessed
tokens `d1..dk` (a proposer's, `proposers.py`) after `t` and runs the `k + 1` rows as one short prefill-like
chunk. Row `i`'s logits are what plain decoding would have computed after `d1..di`, so the guesses are
checked left to right:

- greedy rows accept `d(i+1)` while it is row i's argmax; the first mismatch is replaced by that argmax;
- sampled rows accept `d(i+1)` with probability `p_i(d(i+1))` (the row's distribution after bias,
  temperature, top-k, top-p and min-p), and on a rejection draw from `p_i` with `d(i+1)` removed. The
  proposer's guess is a point mass, so this is the speculative-sampling rule `min(1, p/q)` with the
  residual `max(0, p - q)`: each output token has exactly plain sampling's distribution.

All accepted rows are kept; when every guess held, the last row gives one more token. The keys and values
of rejected guesses are rolled back (`BlockManager.truncate`: pages past the kept length go back to the
pool) before the pages are keyed for the prefix cache, so no cached page ever holds a guess that was not
kept.

The walk still sees one token per call (no model's walk changes): the first token answers the call that
ran the step, the rest wait on the sequence (`SpeculationState.ahead`) and answer the next calls, each of
which feeds back the token the last one returned, without a forward. A call that does not feed back what
was expected (another walk, a fork, an export) first settles the label: the tokens not yet handed out are
dropped and their keys rolled back, as if speculation had never run.

Rows speculate only where verifying is exact and cheap to state: a sampling call of one token, no grammar
(its matcher would have to advance through every guess), no `decode_steps`, no per-token rows, embeddings or
routing ids, no custom mask, not split over ranks. Penalties and biases apply per row over the history that row
continues (the guesses before it included), as plain decoding would have applied them. Positions continue implicitly (M-RoPE included). A row whose guesses
keep failing backs off (it proposes again after 2, 4, ... 32 plain steps), and a step with more sequences
than `max_batch` does not speculate: a verify chunk costs a batch of decodes its replayed step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from mstar_core.errors import ConfigError
from mstar_core.strict import reject_unknown
from mstar_kvcache.proposers import NgramProposer
from mstar_kvcache.sampler import adjust_logits, draw_with, filtered
from mstar_kvcache.sequence import Sequence

METHODS = ("ngram",)
#: The longest back-off, in plain decode steps, of a row whose guesses keep failing.
MAX_BACKOFF = 32


@attrs.frozen(kw_only=True)
class SpeculativeSettings:
    """Setting `speculative` of a kvcache node: `{method: ngram, num_tokens: 4, max_ngram: 3}`.

    `num_tokens` guesses per step; `max_ngram` / `min_ngram` the suffix lengths prompt lookup tries;
    `max_batch` the most sequences a step may hold and still speculate.
    """

    method: str
    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 2
    max_batch: int = 4

    @classmethod
    def from_mapping(cls, values: Any) -> SpeculativeSettings:
        where = "kvcache engine: setting 'speculative'"
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where} must be a mapping like {{method: ngram, num_tokens: 4}}, got {values!r}")
        reject_unknown(values, (f.name for f in attrs.fields(cls)), "kvcache engine", what="setting",
                       shown=lambda k: f"speculative.{k}")
        if values.get("method") not in METHODS:
            raise ConfigError(f"kvcache engine: setting 'speculative.method' must be one of {list(METHODS)}, "
                              f"got {values.get('method')!r}")
        for key in ("num_tokens", "max_ngram", "min_ngram", "max_batch"):
            value = values.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"kvcache engine: setting 'speculative.{key}' must be an integer >= 1, got {value!r}")
        settings = cls(**values)
        if settings.min_ngram > settings.max_ngram:
            raise ConfigError(f"kvcache engine: setting 'speculative.min_ngram' ({settings.min_ngram}) must be at "
                              f"most 'speculative.max_ngram' ({settings.max_ngram})")
        return settings


@attrs.define(eq=False)
class SpeculationState:
    """What speculation keeps on one sequence (`Sequence.speculation`)."""

    #: Guesses appended to `tokens` for the step being planned or run (empty between steps).
    drafts: list[int] = attrs.field(factory=list)
    #: Verified tokens not handed out yet: `(the input the next call must feed back, that call's outputs)`.
    #: Each expected input is already in `tokens` with its keys computed.
    ahead: list[tuple[int, dict[str, Any]]] = attrs.field(factory=list)
    misses: int = 0  # verify steps in a row that kept no guess
    wait: int = 0  # decode steps to run plainly before guessing again


class Speculator:
    """Proposes guesses before a step, trims those the step did not schedule, verifies them after it, and hands
    out the verified tokens to the calls that follow. `answers` (`CallAnswers`) computes logits and finish
    reasons and completes calls; `blocks` rolls keys back."""

    def __init__(self, settings: SpeculativeSettings, node: str, blocks: Any, answers: Any,
                 max_model_len: int | None):
        self.settings, self.node, self.blocks, self.answers = settings, node, blocks, answers
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(settings.max_ngram, settings.min_ngram)
        self.proposed = 0  # guesses verified
        self.accepted = 0  # guesses kept
        self.verify_steps = 0

    def stats(self) -> dict[str, float]:
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted,
                "spec_verify_steps": self.verify_steps}

    # -- before a step ------------------------------------------------------------------------------

    def _budget(self, seq: Sequence) -> int:
        """How many guesses the sequence's pending call may take (0: it decodes plainly)."""
        call, params = seq.call, seq.sampling
        if (seq.readonly or seq.recompute or seq.remaining != 1 or seq.host is not None or call is None
                or call.sampling is None or params is None or call.decode_steps is not None or seq.gathers
                or call.embeds or call.positions is not None or call.routing is not None or call.extras
                or seq.routing is not None or seq.limits is not None
                or call.reset or call.fork_from is not None or call.snapshot_before or call.snapshot_after or call.drop
                or params.grammar is not None or seq.grammar is not None):
            return 0
        # the call returns one token and the guesses kept: never past max_tokens or the model's context
        k = min(self.settings.num_tokens, params.max_tokens - len(seq.generated) - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - len(seq.tokens))
        return max(k, 0)

    def propose(self, pending: list[Sequence]) -> None:
        """Append guesses to the pending decode calls that may speculate (see the module's rules)."""
        writers = [s for s in pending if not s.readonly]
        for seq in writers:
            if seq.speculation is not None:
                seq.speculation.drafts = []
        if len(writers) > self.settings.max_batch:
            return
        pool = self.blocks.pool
        for seq in writers:
            k = self._budget(seq)
            if k < 1:
                continue
            state = seq.speculation
            if state is None:
                state = seq.speculation = SpeculationState()
            if state.wait > 0:
                state.wait -= 1
                continue
            drafts = self.proposer.propose(seq.tokens, k)
            # guesses never take pages another sequence would need this step (no preemption for a guess)
            if not drafts or self.blocks.pages_needed(seq, 1 + len(drafts)) > pool.num_available - len(writers):
                continue
            state.drafts = drafts
            self._extend(seq, drafts)

    @staticmethod
    def _extend(seq: Sequence, drafts: list[int]) -> None:
        if seq.positions is not None:  # implicit positions continue after the largest one, as a call's would
            start = seq.next_position
            steps = torch.arange(start, start + len(drafts), device=seq.positions.device)
            seq.positions = torch.cat((seq.positions, steps.expand(seq.positions.shape[0], -1)), dim=1)
        seq.tokens.extend(drafts)
        seq.token_ids = None

    @staticmethod
    def _retract(seq: Sequence, keep: int) -> None:
        """Take back all but the first `keep` guesses of a sequence that has not computed them."""
        state = seq.speculation
        drop = len(state.drafts) - keep
        if drop <= 0:
            return
        del seq.tokens[len(seq.tokens) - drop:]
        if seq.positions is not None:
            seq.positions = seq.positions[:, : len(seq.tokens)]
        seq.token_ids = None
        del state.drafts[keep:]

    def trim(self, work: list[tuple[Sequence, int]], pending: list[Sequence]) -> None:
        """After scheduling: keep the guesses a sequence runs this step, take back the rest (a short budget, a
        sequence left out or preempted: its guesses must never be computed later as if they were input)."""
        scheduled = {id(seq): n for seq, n in work}
        for seq in pending:
            state = seq.speculation
            if state is None or not state.drafts:
                continue
            self._retract(seq, max(scheduled.get(id(seq), 0) - 1, 0))

    def drop_drafts(self, seq: Sequence) -> None:
        """A step that failed: its guesses go (the failing call's rollback removes their tokens)."""
        if seq.speculation is not None:
            seq.speculation.drafts = []

    # -- after a step --------------------------------------------------------------------------------

    def verify(self, rows: list[tuple[Sequence, int, int]], hidden: torch.Tensor) -> list[Any]:
        """Check each `(sequence, first row, rows)`'s guesses against the forward's `hidden` rows; answer the calls."""
        self.verify_steps += 1
        with torch.inference_mode():
            index = torch.cat([torch.arange(lo, lo + n) for _, lo, n in rows]).to(hidden.device)
            last = hidden.index_select(0, index)
            try:
                logits = self.answers.module.compute_logits(last)
                if self.answers.no_token is not None:
                    self.answers.no_token.fill(logits)
            except Exception as exc:
                for seq, _, n in rows:
                    self._roll_back(seq, n, 0)
                return [self.answers.fail(seq, exc) for seq, _, _ in rows]
        results = []
        at = 0
        for seq, _, n in rows:
            part = slice(at, at + n)
            at += n
            try:
                results.append(self._verify_one(seq, n, logits[part], last[part]))
            except Exception as exc:  # this row's parameters broke its verification: it alone fails
                self._roll_back(seq, n, 0)
                results.append(self.answers.fail(seq, exc))
        return results

    def _roll_back(self, seq: Sequence, n: int, kept: int) -> None:
        """The step computed `n` rows (the fed token and `n - 1` guesses): keep the fed token and `kept` guesses."""
        state = seq.speculation
        seq.num_computed += n
        self.blocks.truncate(seq, len(seq.tokens) - len(state.drafts) + kept)
        state.drafts = []
        self.blocks.commit(seq)  # only now: a page keyed for the prefix cache holds only tokens that were kept

    def _verify_one(self, seq: Sequence, n: int, raw: torch.Tensor, hidden: torch.Tensor) -> Any:
        state = seq.speculation
        drafts = state.drafts
        params = seq.sampling
        with torch.inference_mode():
            logits = raw.float()
            if params.adjusts_logits:  # bias and penalties, each row over the history it continues (guesses included)
                base = len(seq.tokens) - len(drafts)
                logits = adjust_logits(logits, [params] * n, [seq.tokens[: base + i] for i in range(n)],
                                       [seq.generated + drafts[:i] for i in range(n)])
            if params.greedy:
                best = logits.max(-1).indices.tolist()
                kept = 0
                while kept < n - 1 and best[kept] == drafts[kept]:
                    kept += 1
                outputs = drafts[:kept] + [best[kept]]
            else:
                outputs = self._sample(logits, drafts, params, seq.generator)
        kept = len(outputs) - 1
        # finish reasons token by token: the first that finishes ends the outputs (stop, stop sequence, length)
        reasons: list[str | None] = []
        for token in outputs:
            seq.generated.append(token)
            reasons.append(self.answers.finish_reason(seq, token))
            if reasons[-1] is not None:
                break
        del seq.generated[len(seq.generated) - len(reasons):]
        outputs = outputs[: len(reasons)]
        self.proposed += len(drafts)
        self.accepted += min(kept, len(outputs) - 1)
        state.misses = 0 if kept else state.misses + 1
        state.wait = 0 if kept else min(2 ** state.misses, MAX_BACKOFF)
        self._roll_back(seq, n, len(outputs) - 1)
        outs = [self._outputs(seq, i, token, reasons[i], raw, hidden) for i, token in enumerate(outputs)]
        # the next calls feed back outputs[0..]: each is answered with the token after it
        state.ahead = [(outputs[i], outs[i + 1]) for i in range(len(outputs) - 1)]
        seq.generated.append(outputs[0])
        return self.answers.complete(seq, outs[0])

    @staticmethod
    def _sample(logits: torch.Tensor, drafts: list[int], params: Any, generator: torch.Generator | None) -> list[int]:
        """Sampled verification of `drafts` against the rows of `logits` (see `verify_draws`)."""
        n = logits.shape[0]
        probs, keep = filtered(logits, [params] * n)
        u = torch.rand(1, len(drafts) + 1, generator=generator, dtype=torch.float64, device=logits.device)
        kept, last = verify_draws(probs * keep, drafts, u)
        return drafts[: int(kept[0])] + [int(last[0])]

    def _outputs(self, seq: Sequence, i: int, token: int, reason: str | None, raw: torch.Tensor,
                 hidden: torch.Tensor) -> dict[str, Any]:
        """Row `i`'s call outputs, as plain decoding's `CallAnswers._answer` would give them."""
        out: dict[str, Any] = {"next_token": token, "finish_reason": reason}
        params = seq.sampling
        answers = self.answers
        if answers.returns_logprobs and params.logprobs is not None:
            row = raw[i].float()
            normaliser = torch.logsumexp(row, dim=-1)
            out["logprob"] = float(row[token] - normaliser)
            k = min(params.logprobs, row.shape[0])
            if k:
                values, ids = row.topk(k)
                out["top_logprobs"] = list(zip(ids.tolist(), (values - normaliser).tolist(), strict=True))
        if answers.returns_logits:
            out["logits"] = raw[i]
        if answers.returns_hidden:
            out["hidden"] = hidden[i]
        return out

    # -- the calls after a verify --------------------------------------------------------------------

    def answer_ahead(self, seq: Sequence, inv: Any, parsed: Any) -> dict[str, Any] | None:
        """The outputs of `inv` if it feeds back the token the last call returned and a verified token waits for
        it; None otherwise (the sequence is settled first when tokens were waiting)."""
        state = seq.speculation
        if state is None or not state.ahead:
            return None
        expected, out = state.ahead[0]
        plain = (seq.pending is None and parsed.ids == [expected] and parsed.write_cache and not parsed.reset
                 and parsed.fork_from is None and not parsed.embeds and parsed.positions is None
                 and parsed.routing is None and not parsed.extras and parsed.output_index is None
                 and parsed.decode_steps is None and not parsed.snapshot_before and not parsed.snapshot_after
                 and not parsed.drop and not parsed.bidirectional and parsed.frame_size is None
                 and parsed.blocks is None and parsed.output_rows in (None, "last") and parsed.sampling is not None
                 and parsed.sampling == seq.sampling and not inv.options.get("transfer"))
        if not plain:
            self.settle(seq)
            return None
        state.ahead.pop(0)
        seq.generated.append(out["next_token"])
        seq.priority, seq.arrival = inv.priority, inv.arrival
        return out

    def settle(self, seq: Sequence | None) -> None:
        """Drop the verified tokens no call has taken: their inputs leave the sequence, their keys roll back."""
        state = None if seq is None else seq.speculation
        if state is None or not state.ahead:
            return
        waiting = len(state.ahead)
        state.ahead = []
        self.blocks.truncate(seq, len(seq.tokens) - waiting)


def verify_draws(weights: torch.Tensor, drafts: list[int], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of point-mass guesses, for `S` independent draws at once.

    `weights` `[k + 1, vocab]` are each row's unnormalised sampling weights, `drafts` the `k` guesses, `u`
    `[S, k + 1]` uniform numbers. Guess `i` is accepted with probability `p_i(guess)` (column `i` of `u`)
    while every guess before it was; the first rejected row draws from its distribution with the guess
    removed (`max(0, p - q)` for a point mass `q`), and when every guess held the last row draws plainly
    (both with column `k`). Returns the guesses kept `[S]` and the token after them `[S]`.
    """
    k = len(drafts)
    probs = weights / weights.sum(-1, keepdim=True)
    if k:
        guessed = probs[torch.arange(k, device=probs.device), torch.tensor(drafts, device=probs.device)]
        accepted = (u[:, :k] < guessed.double().unsqueeze(0)).long()
        kept = accepted.cumprod(1).sum(1)
    else:
        kept = torch.zeros(u.shape[0], dtype=torch.long, device=u.device)
    rows = probs.index_select(0, kept)
    rejected = (kept < k).nonzero().flatten()
    if rejected.numel():
        guesses = torch.tensor(drafts + [0], device=probs.device).index_select(0, kept.index_select(0, rejected))
        rows[rejected, guesses] = 0.0
    return kept, draw_with(rows, None, u[:, k])
