"""Per-row grammar state of a sampling label, and the token masks it puts on a batch's logits.

A label whose call's sampling carries a `grammar` gets a `RowGrammar`: an xgrammar matcher over the module's
`grammar_vocab` (`mstar_core.grammar.GrammarVocab`; a module without one refuses grammars). Before a row's
token is drawn, every token the grammar cannot take next is masked to -inf on that row alone; rows without a
grammar are not touched, so they draw what they would alone. The chosen token then advances the matcher.
A call without sampling (a prompt write, whose token the walk drops) is not masked and advances nothing.

The state follows the label: preemption only recomputes keys and values (the tokens, and so the matcher, stay);
a fork gets a copy of the matcher (`fork`); a label that arrives with tokens already generated (a cache moved
from another engine) replays them into a fresh matcher before its next token.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from mstar_core.errors import RequestError
from mstar_core.grammar.compile import compiled
from mstar_core.grammar.spec import GrammarSpec

_SHIFTS: dict[torch.device, torch.Tensor] = {}


@attrs.define(eq=False)
class RowGrammar:
    """One label's grammar: the spec it follows and the matcher at the label's last sampled token."""

    spec: GrammarSpec
    matcher: Any
    #: The last sampled token was not one the grammar allows (only when every token was masked): the call fails.
    rejected: bool = False

    def fork(self) -> RowGrammar:
        return RowGrammar(self.spec, self.matcher.fork())

    @property
    def finished(self) -> bool:
        """The grammar is complete and took its stop token: nothing more may follow."""
        return bool(self.matcher.is_terminated())


def grammar_for(node: str, vocab: Any, spec: GrammarSpec, replay: list[int]) -> RowGrammar:
    """A fresh `RowGrammar` for `spec` with `replay` (tokens already generated under it) accepted."""
    import xgrammar as xgr

    if vocab is None:
        raise RequestError(f"node '{node}': this model's module declares no grammar_vocab, so it cannot decode under "
                           "a grammar (response_format, tools); leave them out", param="response_format")
    matcher = xgr.GrammarMatcher(compiled(vocab, spec))
    for token in replay:
        if not matcher.accept_token(int(token)):
            raise RequestError(f"node '{node}': the tokens generated so far do not fit the request's grammar")
    return RowGrammar(spec, matcher)


def attach(node: str, vocab: Any, seqs: list[Any]) -> list[RowGrammar | None]:
    """Each row's grammar for this step (made or replaced as its sampling asks, dropped when it asks for none)."""
    out: list[RowGrammar | None] = []
    for seq in seqs:
        if seq.call is not None and seq.call.sampling is None:  # a prompt write: its token is dropped, so the
            out.append(None)  # grammar (the label's, kept as it is) neither masks nor takes it
            continue
        spec = None if seq.sampling is None else seq.sampling.grammar
        if spec is None:
            seq.grammar = None
        elif seq.grammar is None:  # first token under it, or a moved label: replay what it generated
            seq.grammar = grammar_for(node, vocab, spec, seq.generated)
        elif seq.grammar.spec != spec:  # a new grammar from this call on
            seq.grammar = grammar_for(node, vocab, spec, [])
        out.append(seq.grammar)
    return out


def _bits(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def apply_masks(logits: torch.Tensor, grammars: list[RowGrammar | None]) -> torch.Tensor:
    """`logits` with each grammar row's disallowed tokens at -inf: a masked copy, or `logits` itself when no row
    has a grammar. Columns past the grammar's vocabulary (none in practice) stay as they are."""
    import xgrammar as xgr

    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    n, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        grammars[i].matcher.fill_next_token_bitmask(bitmask, j)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = ((bitmask.unsqueeze(-1) >> _bits(logits.device)) & 1).view(len(rows), -1)[:, :vocab].bool()
    if len(rows) == n:
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out


def advance(grammars: list[RowGrammar | None], tokens: list[int]) -> None:
    """Feed each grammar row its chosen token (a token it refuses marks the row `rejected`)."""
    for grammar, token in zip(grammars, tokens, strict=True):
        if grammar is not None and not grammar.matcher.accept_token(int(token)):
            grammar.rejected = True
