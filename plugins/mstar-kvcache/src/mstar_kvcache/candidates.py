"""Top-k rows sampled over their k candidates instead of the whole vocabulary.

With top-k set, every token outside the k largest logits has probability 0 after the filter, so
temperature, the log-softmax, top-p and min-p need only those k values: one `topk` over the
vocabulary, then `[rows, k]`-sized work, where the whole-vocabulary path pays a dozen passes over
every id (a 30,720-id row with top-k 50: 1.3-1.9 -> 0.34-0.53 ms CPU at one thread, benchmarks/sampler_cost.py). The candidates are put back in
vocabulary order before the draw, so a row's uniform number picks the token the whole-vocabulary
path would pick: the same kept set and the same cumulative order, the probabilities equal up to
the rounding of a normaliser summed over k values instead of the row (about one float32 ulp, so a
token differs only when the uniform number falls within that of a boundary).

A row keeps more than k tokens when logits tie with its k-th (the full path keeps every tie, as
transformers does): `take` flags such rows, and rows whose logits are not finite (the full path's
NaN rules apply), for the whole-vocabulary path. Whether a row narrows depends on its own
parameters and logits only, and its candidate count is its own k, so a row samples the same
whatever shares its batch.
"""

from __future__ import annotations

import math

import torch

from mstar_core.sampling import MIN_TEMPERATURE, SamplingParams

#: A row samples over its candidates when its top-k is at most 1/NARROW of the vocabulary (beyond that the
#: `topk` itself costs about what the passes it saves do).
NARROW = 8


def narrows(params: SamplingParams, vocab: int) -> bool:
    """Whether a stochastic row samples over its top-k candidates (a rule of the row, never of its batch)."""
    return 1 < params.top_k <= vocab // NARROW


def take(logits: torch.Tensor, k: int, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows sharing top-k `k`: `(ids, weights, wide)`: `[m, k]` candidate ids in vocabulary order and their weights.

    `weights` are the temperature-scaled probabilities over the candidates, zero where top-p or min-p
    drop a token. `wide` lists the rows (of `logits`) left out because their k-th logit ties with the
    next or their logits are not finite: those go to the whole-vocabulary path; the `m` rows
    returned are the others, in order.
    """
    values, ids = logits.topk(k + 1, dim=-1)  # descending; NaN and +inf come first
    # the same float32 quotient as the whole-vocabulary path's, so ties it creates by rounding are seen here too
    scaled = values / _per_row(values, [max(p.temperature, MIN_TEMPERATURE) for p in params], values.dtype)
    wide = [i for i, (top, kth, after) in enumerate(scaled[:, [0, k - 1, k]].tolist())
            if not math.isfinite(top) or (after == kth and kth > -math.inf)]
    if wide:
        left = set(wide)
        ok = torch.tensor([i for i in range(len(params)) if i not in left], device=logits.device,
                          dtype=torch.long)
        scaled, ids, params = scaled[ok], ids[ok], [params[i] for i in ok.tolist()]
    probs = scaled[:, :k].log_softmax(-1).exp()
    keep = None
    if any(p.top_p < 1.0 for p in params):
        # the whole-vocabulary rule (`sampler._top_p_keep`): rank by probability, keep the prefix whose mass
        # strictly above each token is at most top_p, and every token as probable as the last one kept
        wide_probs = probs.double()
        above = wide_probs.cumsum(1) - wide_probs
        top_p = _per_row(above, [p.top_p if p.top_p < 1.0 else math.inf for p in params], torch.float64)
        kept = (above <= top_p).sum(1, keepdim=True)  # >= 1: nothing is above the first candidate
        keep = probs >= probs.gather(1, kept - 1)
    if any(p.min_p > 0 for p in params):
        min_p = _per_row(probs, [p.min_p for p in params], probs.dtype)
        floor = probs >= min_p * probs[:, :1]  # the first candidate is the row's most probable
        keep = floor if keep is None else keep & floor
    weights = probs if keep is None else probs * keep
    ids, order = ids[:, :k].sort(-1)
    return ids, weights.gather(1, order), wide


def _per_row(like: torch.Tensor, values: list[float], dtype: torch.dtype) -> torch.Tensor | float:
    """`values` as a `[n, 1]` column, or the one float when every row has the same (one op fewer per use)."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, device=like.device, dtype=dtype).unsqueeze(1)
