"""One request's token sequence under one cache label, and what the engine tracks about it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from mstar_core.runtime.engine import Invocation
    from mstar_core.sampling import SamplingParams


@attrs.define(eq=False)
class Sequence:
    """Tokens appended so far, the pages holding their keys and values, and the invocation in flight.

    Invariant between steps: `len(pages) == ceil(num_computed / page_size)`. Tokens past
    `num_computed` are waiting to be run (a prefill, a chunk of one, a decode, or a recompute after
    preemption). `hashes[i]` is the chained hash of full page `i` once it is known.
    """

    request_id: str
    label: str
    tokens: list[int] = attrs.field(factory=list)
    pages: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    hashes: list[bytes] = attrs.field(factory=list)
    #: False once the sequence holds non-causal masks: a page's keys then depend on tokens after it.
    cacheable: bool = True
    #: Per-token exclusive limit on visible key positions for non-causal masks; None = plain causal.
    limits: list[int] | None = None
    #: `(start position, [n, hidden] tensor)` rows that replace the token embeddings there.
    embeds: list[tuple[int, torch.Tensor]] = attrs.field(factory=list)
    generated: list[int] = attrs.field(factory=list)
    generator: torch.Generator | None = None
    sampling: SamplingParams | None = None
    pending: Invocation | None = None
    pending_start: int = 0
    #: Whether the pending invocation may be split over several steps (False for non-causal blocks).
    chunkable: bool = True
    arrival: float = 0.0
    priority: float = 0.0
    order: int = 0  # admission order, for FIFO ties
    #: Explicit RoPE positions `[axes, len(tokens)]` once any call gave some; None = position is the index.
    positions: torch.Tensor | None = None
    #: Per-token routing ids (mixture-of-transformers) once any call gave some; earlier tokens route to 0.
    routing: list[int] | None = None
    #: Module-declared per-call tensors kept for recompute and cache keys: `(start, end, name, value, per_token)`.
    extras: list[tuple[int, int, str, torch.Tensor, bool]] = attrs.field(factory=list)
    #: A read-only call: attends to `context` (frozen pages it holds references to) plus its own tokens.
    readonly: bool = False
    context: list[tuple[list[int], int]] = attrs.field(factory=list)
    #: A read-only call's flat slots of `context`'s keys (the context never changes under it).
    context_slots: torch.Tensor | None = None
    #: `(tokens, pages, slots)`: this label's key slots as a read-only call last read them, reused while unchanged.
    frozen_slots: tuple[int, list[int], torch.Tensor] | None = None
    #: Per-token output rows of the pending call, gathered across prefill chunks.
    collected: list[torch.Tensor] = attrs.field(factory=list)
    #: Whether the pending call's rows are gathered into `collected` (set when it attaches).
    gathers: bool = False
    #: The first token whose row the pending call returns (a prefix-cache hit stops before it); None: the last only.
    rows_from: int | None = None
    #: The pending call as parsed (`inputs.ParsedInvocation`): what to return and what to do when it is done.
    call: Any = None
    #: Set when a reader needs this (preempted, idle) label's cache back: it is recomputed without a call.
    recompute: bool = False
    #: Tokens the pending `decode_steps` call sampled so far (each already appended as its next input).
    stepped: list[int] = attrs.field(factory=list)
    #: The grammar the label's sampling follows, at its last sampled token (`grammar.RowGrammar`); None: free.
    grammar: Any = None
    #: `tokens` mirrored as a tensor for the repetition penalty (`history.TokenIds`); dropped when `tokens` shrinks.
    token_ids: Any = None
    #: While preempted with setting `kv_offload`: the host copy of its pages (`offload.HostCopy`), restored on admission.
    host: Any = None
    #: Speculative decoding's guesses and verified tokens not handed out yet (`speculative.SpeculationState`).
    speculation: Any = None
    #: The request's cross-attention label its calls named (`cross.py`): every step of it attends to that label too.
    cross_label: str | None = None
    #: The LoRA adapter its keys and values were computed under (`lora.NodeAdapters` key `name#load`); None: the base.
    lora: str | None = None

    @property
    def next_position(self) -> int:
        """The position an implicit next token takes: after the largest one so far."""
        if self.positions is None or self.positions.shape[1] == 0:
            return len(self.tokens)
        return int(self.positions.max()) + 1
    @property
    def remaining(self) -> int:
        """Tokens appended but not yet in the cache."""
        return len(self.tokens) - self.num_computed

    @property
    def key(self) -> tuple[str, str]:
        return (self.request_id, self.label)
