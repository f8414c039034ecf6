"""Next-token sampling for a batch of rows, each with its own `SamplingParams` and generator.

Greedy rows are one vectorised argmax. Stochastic rows are filtered together (temperature,
top-k, top-p, min-p in sorted space) and drawn row by row from each request's own generator,
so a seeded request gets the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import attrs
import torch

from mstar_core.sampling import GREEDY, SamplingParams


@attrs.define
class Sampled:
    """Chosen tokens with their log-probabilities under the model (before any sampling transform)."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]


def apply_repetition_penalty(logits: torch.Tensor, history: list[list[int]], penalties: list[float]) -> None:
    """Divide positive and multiply negative logits of already-seen tokens by the penalty, in place."""
    for row, (seen, penalty) in enumerate(zip(history, penalties, strict=True)):
        if penalty == 1.0 or not seen:
            continue
        ids = torch.tensor(sorted(set(seen)), device=logits.device)
        vals = logits[row, ids]
        logits[row, ids] = torch.where(vals > 0, vals / penalty, vals * penalty)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over the tokens sorted by logit (descending) after every filter, and the sort order."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    sorted_logits, order = torch.sort(logits / temp, dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=dev).unsqueeze(0)
    top_k = torch.tensor([p.top_k or logits.shape[1] for p in params], device=dev).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
    before = probs.cumsum(-1) - probs  # mass strictly above each token; the first token always stays
    drop = before > top_p
    min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
    drop |= probs < min_p * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True), order


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams | None],
    generators: list[torch.Generator | None],
    history: list[list[int]],
) -> Sampled:
    """Pick one token per row of `logits` `[N, vocab]`; `history` feeds the repetition penalty."""
    logits = logits.float()
    params = [p or GREEDY for p in params]
    # logprob of the pick = logit - logsumexp: avoids materialising a full log-softmax every step
    normaliser = torch.logsumexp(logits, dim=-1)
    raw = logits
    if any(p.repetition_penalty != 1.0 for p in params):
        logits = logits.clone()
        apply_repetition_penalty(logits, history, [p.repetition_penalty for p in params])
    chosen = logits.argmax(-1)
    stochastic = [i for i, p in enumerate(params) if not p.greedy]
    if stochastic:
        rows = torch.tensor(stochastic, device=logits.device)
        probs, order = _filtered_probs(logits[rows], [params[i] for i in stochastic])
        for j, i in enumerate(stochastic):
            pick = torch.multinomial(probs[j], 1, generator=generators[i])
            chosen[i] = order[j, pick[0]]
    picked = raw.gather(1, chosen.unsqueeze(1)).squeeze(1) - normaliser
    tops: list[list[tuple[int, float]] | None] = [None] * len(params)
    wanted = [p.logprobs or 0 for p in params]
    if max(wanted) > 0:
        values, ids = raw.topk(max(wanted), dim=-1)
        values = values - normaliser.unsqueeze(1)
        for i, k in enumerate(wanted):
            if k:
                tops[i] = list(zip(ids[i, :k].tolist(), values[i, :k].tolist(), strict=True))
    return Sampled(chosen.tolist(), picked.tolist(), tops)
