"""Next-token sampling for a batch of rows, each with its own `SamplingParams` and generator.

Every filter runs once over the whole `[rows, vocab]` batch with per-row parameters, and nothing
sorts the vocabulary: top-k takes the k-th largest logit (as transformers' warper does), top-p
finds its cut with a histogram of log-probabilities (only the one bucket the cut falls in is
ranked exactly), min-p compares with the row maximum. The draw is one uniform number per row
from that request's own generator, mapped through the cumulative distribution of the kept
tokens in vocabulary order, so a seeded request gets the same tokens whatever shares its batch.
A row with a small top-k does all of this over its k candidates only (`candidates`), drawing the
token the whole-vocabulary pass would.

A batch whose rows are all greedy, with nothing to adjust or report, takes each row's argmax where the logits lie
(`mstar_core.nn.logits.greedy_tokens`: one pass over each row as the head wrote it, bf16 included). On a CPU a row at a
temperature alone (no top-k, top-p or min-p) is drawn by a kernel (`drawn_tokens`: three passes over the row, the same
distribution; by the row's own uniform number, whatever shares its batch) instead of the filters below.

Before all that, `adjust_logits` applies the rows' logit biases and penalties (see `SamplingParams`);
a batch in which no row sets one skips it after one look at the parameters.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import attrs
import torch

from mstar_core.nn.logits import drawn_tokens, draws, greedy_tokens
from mstar_core.sampling import GREEDY, SamplingParams
from mstar_kvcache import candidates
from mstar_kvcache import grammar as grammar_masks

#: Histogram resolution for the top-p cut: buckets per nat of log-probability, and how far down they go.
_PER_NAT = 256
_BUCKETS = _PER_NAT * 32
#: Temperatures are floored here: below it the float32 quotient of ordinary logits overflows (or the
#: temperature itself rounds to 0) and the row's log-probabilities turn NaN. The edge refuses such
#: values; the floor keeps a value that came another way from breaking the whole batch.
_MIN_TEMPERATURE = 1e-5


@attrs.define
class Sampled:
    """Chosen tokens with their log-probabilities under the model (before any sampling transform)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def apply_repetition_penalty(logits: torch.Tensor, history: list[Sequence[int]], penalties: list[float]) -> None:
    """Divide positive and multiply negative logits of already-seen tokens by the penalty, in place.

    A row's history is a list of ids or an int64 `array` of them (the engine's `TokenIds` mirror).
    """
    rows = [i for i, (seen, p) in enumerate(zip(history, penalties, strict=True)) if p != 1.0 and len(seen)]
    if not rows:
        return
    dev = logits.device
    ids = _padded_ids([history[i] for i in rows]).to(dev)
    penalty = _column([penalties[i] for i in rows], dev, logits.dtype)
    whole = len(rows) == logits.shape[0]
    target = logits if whole else logits[torch.tensor(rows, device=dev)]
    vals = target.gather(1, ids)
    target.scatter_(1, ids, torch.where(vals > 0, vals / penalty, vals * penalty))
    if not whole:
        logits[torch.tensor(rows, device=dev)] = target


def _padded_ids(rows: list[Sequence[int]]) -> torch.Tensor:
    """`[len(rows), longest]` int64 ids, each row padded with its own first id (a repeated index gathers and
    scatters the same value). Built as bytes: `torch.tensor` over nested lists costs ~200 ns an id."""
    width = max(len(r) for r in rows)
    buf = bytearray()
    for r in rows:
        buf += r if isinstance(r, array) and r.typecode == "q" else array("q", r)
        if len(r) < width:
            buf += array("q", [r[0]]) * (width - len(r))
    return torch.frombuffer(buf, dtype=torch.long).view(len(rows), width)


def apply_logit_bias(logits: torch.Tensor, biases: list[tuple[tuple[int, float], ...]]) -> None:
    """Add each row's `(token id, bias)` pairs to its logits, in place."""
    rows = [i for i, pairs in enumerate(biases) for _ in pairs]
    if not rows:
        return
    dev = logits.device
    cols = torch.tensor([t for pairs in biases for t, _ in pairs], device=dev)
    vals = torch.tensor([b for pairs in biases for _, b in pairs], device=dev, dtype=logits.dtype)
    logits.index_put_((torch.tensor(rows, device=dev), cols), vals, accumulate=True)


def apply_presence_frequency(logits: torch.Tensor, generated: list[list[int]], presence: list[float],
                             frequency: list[float]) -> None:
    """Subtract `frequency * count + presence * (count > 0)` per token, counts over each row's generated ids, in place.

    OpenAI's documented formula (`mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence`).
    """
    rows = [i for i, (p, f) in enumerate(zip(presence, frequency, strict=True)) if (p or f) and generated[i]]
    if not rows:
        return
    dev = logits.device
    width = max(len(generated[i]) for i in rows)
    # pad with token 0 at weight 0, so padding adds nothing to any count
    ids = torch.tensor([generated[i] + [0] * (width - len(generated[i])) for i in rows], device=dev)
    ones = torch.tensor([[1.0] * len(generated[i]) + [0.0] * (width - len(generated[i])) for i in rows],
                        device=dev, dtype=logits.dtype)
    counts = torch.zeros(len(rows), logits.shape[1], device=dev, dtype=logits.dtype).scatter_add_(1, ids, ones)
    pres = torch.tensor([presence[i] for i in rows], device=dev, dtype=logits.dtype).unsqueeze(1)
    freq = torch.tensor([frequency[i] for i in rows], device=dev, dtype=logits.dtype).unsqueeze(1)
    index = torch.tensor(rows, device=dev)
    logits[index] -= counts * freq + (counts > 0).to(logits.dtype) * pres


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], history: list[Sequence[int]],
                  generated: list[list[int]]) -> torch.Tensor:
    """`logits` after the rows' logit biases, repetition penalties and presence/frequency penalties, in that order.

    `history` is each row's whole sequence (prompt included: the repetition penalty, as transformers
    applies it), `generated` its sampled tokens (presence and frequency, as OpenAI counts them).
    Returns `logits` itself when no row adjusts anything, else an adjusted copy.
    """
    if not any(p.adjusts_logits for p in params):
        return logits
    logits = logits.clone()
    apply_logit_bias(logits, [p.logit_bias for p in params])
    if any(p.repetition_penalty != 1.0 for p in params):
        apply_repetition_penalty(logits, history, [p.repetition_penalty for p in params])
    apply_presence_frequency(logits, generated, [p.presence_penalty for p in params],
                             [p.frequency_penalty for p in params])
    return logits


def _top_k(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask every logit below the row's k-th largest with -inf (ties with the k-th stay, as in transformers)."""
    vocab = scaled.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if not any(ks):
        return scaled
    kth = scaled.topk(max(ks), dim=-1).values
    pick = torch.tensor([max(k, 1) - 1 for k in ks], device=scaled.device).unsqueeze(1)
    bound = kth.gather(1, pick)
    bound = bound.masked_fill(torch.tensor(ks, device=scaled.device).unsqueeze(1) == 0, float("-inf"))
    return scaled.masked_fill(scaled < bound, float("-inf"))


def _top_p_keep(logp: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Tokens whose probability mass strictly above them is <= top_p (the nucleus), without a sort.

    A histogram of log-probabilities gives the mass of every bucket; buckets entirely above the cut
    are kept, those entirely below dropped, and only the few tokens of the bucket the cut falls in
    are ranked.
    """
    rows = logp.shape[0]
    bucket = logp.mul(-_PER_NAT).clamp_(max=_BUCKETS - 1).long()  # logp <= 0: truncation is floor
    mass = torch.zeros(rows, _BUCKETS, dtype=probs.dtype, device=logp.device).scatter_add_(1, bucket, probs).double()
    cum = mass.cumsum(1)
    crit = (cum <= top_p).sum(1, keepdim=True)
    # a row whose total rounding left under top_p keeps everything: every bucket is "above" its cut
    above_cut, crit = crit, crit.clamp(max=_BUCKETS - 1)
    before = (cum.gather(1, crit) - mass.gather(1, crit)).squeeze(1)  # mass of the buckets above the critical one
    in_crit = bucket == crit
    # rank the critical bucket's tokens: sort by (row ascending, probability descending) in one flat sort.
    # (1-D `index_select` rather than tensor indexing: the same values, a fraction of the per-call overhead,
    # which is most of this function's cost at small vocabularies)
    row, col = in_crit.nonzero(as_tuple=True)
    if row.numel() == 0:  # only rows that keep everything
        return bucket < above_cut
    vals = probs[row, col].double()
    order = torch.sort(row.double() * 2 - vals).indices
    row, vals = row.index_select(0, order), vals.index_select(0, order)
    count = torch.bincount(row, minlength=rows)
    first = count.cumsum(0) - count
    above_all = vals.cumsum(0) - vals  # mass above each token among all rows' candidates
    above = before.index_select(0, row) + above_all - above_all.index_select(0, first.index_select(0, row))
    ok = above <= (top_p.squeeze(1).index_select(0, row) if isinstance(top_p, torch.Tensor) else top_p)
    kept = torch.bincount(row.masked_select(ok), minlength=rows)  # the kept candidates are a prefix of each row's ranking
    smallest = vals.index_select(0, (first + kept - 1).clamp_(0, vals.shape[0] - 1))
    bound = torch.where(kept > 0, smallest, float("inf")).to(probs.dtype).unsqueeze(1)
    return (bucket < above_cut) | (in_crit & (probs >= bound))


def _column(values: list[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor | float:
    """Per-row `[n, 1]` values of `dtype`, or the one float when every row has the same: two tensor ops fewer.

    Only for float32 and float64, where a Python float operand gives the same result as a tensor of
    that dtype (a half-precision tensor and a Python float compute in another precision).
    """
    if dtype in (torch.float32, torch.float64) and all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, device=device, dtype=dtype).unsqueeze(1)


def filtered(logits: torch.Tensor, params: list[SamplingParams], *, for_draw: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after temperature and top-k `[n, vocab]`, and the mask of tokens top-p and min-p keep.

    Sampling from `probs * keep` (renormalised) is transformers' temperature, top-k, top-p, min-p chain.
    `for_draw`: the mask only weights a draw, so it may keep tokens of probability 0 (two passes fewer),
    and is None when no row filters.
    """
    dev = logits.device
    # one temperature for every row divides by a float (the same float32 quotient, two tensor ops fewer), and
    # 1 leaves the logits as they are
    temp = _column([max(p.temperature, _MIN_TEMPERATURE) for p in params], dev, logits.dtype)
    scaled = logits if isinstance(temp, float) and temp == 1.0 else logits / temp
    scaled = _top_k(scaled, params)
    # A row the model (or a penalty) made non-finite has NaN log-probabilities. As -inf they weigh
    # nothing: the row still gets a token, and no NaN reaches the histogram's indices or the
    # ranking sort that all rows share.
    logp = scaled.log_softmax(-1).nan_to_num_(nan=float("-inf"), posinf=0.0, neginf=float("-inf"))
    probs = logp.exp()
    keep = None if for_draw else probs > 0
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        top_p = _column([params[i].top_p for i in nucleus], dev, torch.float64)
        if len(nucleus) == len(params):
            cut = _top_p_keep(logp, probs, top_p)
            keep = cut if keep is None else keep.logical_and_(cut)
        else:
            idx = torch.tensor(nucleus, device=dev)
            keep = torch.ones_like(probs, dtype=torch.bool) if keep is None else keep
            keep[idx] &= _top_p_keep(logp[idx], probs[idx], top_p)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=probs.dtype).unsqueeze(1)
        floor = probs >= min_p * probs.max(-1, keepdim=True).values
        keep = floor if keep is None else keep.logical_and_(floor)
    return probs, keep


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One float64 uniform number per row from the row's own generator, in row order."""
    if len(generators) == 1:
        return torch.rand(1, generator=generators[0], dtype=torch.float64, device=device)
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device) for g in generators])


def draw(probs: torch.Tensor, keep: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row with probability proportional to `probs` over `keep`, from the row's own generator."""
    return draw_with(probs, keep, uniforms(generators, probs.device))


def draw_with(probs: torch.Tensor, keep: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """The column whose cumulative weight (`probs` over `keep`, in column order) first exceeds `u` of the row's total."""
    weights = probs if keep is None else probs * keep
    # float32 is enough: adding a zero weight leaves the running sum unchanged, so a dropped token
    # can never be the first index whose cumulative weight exceeds the target
    cdf = weights.cumsum(1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1].double()).to(cdf.dtype).unsqueeze(1), right=True).squeeze(1)
    vocab = probs.shape[1]
    if bool((picks >= vocab).any()):  # u * total rounded up to total: take the last kept token
        last = vocab - 1 - (weights.flip(1) > 0).int().argmax(1)
        picks = torch.where(picks >= vocab, last, picks)
    return picks


def _temperature_only(params: SamplingParams, vocab: int) -> bool:
    """Whether a stochastic row draws from its softmax at a temperature alone (no top-k, top-p or min-p filter)."""
    return (params.top_k == 0 or params.top_k >= vocab) and params.top_p >= 1.0 and params.min_p == 0


def _draw_at_temperature(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows that filter nothing, drawn by the CPU kernel (`drawn_tokens`: three passes over a row, not ten torch ops;
    `draws(logits)` first), each by its `u`; a row whose maximum is not finite by `filtered` and `draw_with`, alone
    (so a row's token never depends on its batch)."""
    drawn = drawn_tokens(logits, [max(p.temperature, _MIN_TEMPERATURE) for p in params], u)
    if drawn is None:  # (`draws` said it would: only no memory for the weights stops it)
        raise MemoryError("no memory for the sampling kernel's weights")
    odd = (drawn < 0).nonzero().flatten().tolist()
    for i in odd:
        probs, keep = filtered(logits[i : i + 1], [params[i]], for_draw=True)
        drawn[i] = draw_with(probs, keep, u[i : i + 1])[0]
    return drawn


def pick(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per (stochastic) row: top-k rows over their candidates (`candidates`), the others over the vocabulary.

    Every row's filters run before the first uniform number is drawn (a bad row raises with no
    generator advanced), and the numbers are drawn in row order, as one whole-vocabulary pass would.
    """
    n, vocab = logits.shape
    dev = logits.device
    by_k: dict[int, list[int]] = {}
    wide: list[int] = []
    plain: list[int] = []  # rows at a temperature alone, drawn by the CPU kernel (a rule of the row, never its batch)
    drawable = draws(logits)
    for i, p in enumerate(params):
        if candidates.narrows(p, vocab):
            by_k.setdefault(p.top_k, []).append(i)
        elif drawable and _temperature_only(p, vocab):
            plain.append(i)
        else:
            wide.append(i)
    if len(plain) == n:  # the usual sampled batch: every row at a temperature alone, all drawn by the kernel
        return _draw_at_temperature(logits, params, uniforms(generators, dev))
    if not by_k and not plain:  # every row over the whole vocabulary (no top-k): no per-group index bookkeeping
        probs, keep = filtered(logits, params, for_draw=True)
        return draw_with(probs, keep, uniforms(generators, dev))
    narrow = []  # (rows, candidate ids, weights) per top-k
    for k, rows in by_k.items():
        whole = len(rows) == n
        ids, weights, left_out = candidates.take(logits if whole else logits[torch.tensor(rows, device=dev)], k,
                                                 [params[i] for i in rows])
        if left_out:  # ties at the k-th or non-finite logits: those rows take the whole vocabulary
            dropped = set(left_out)
            wide.extend(rows[j] for j in left_out)
            rows, whole = [r for j, r in enumerate(rows) if j not in dropped], False
        narrow.append((rows, whole, ids, weights))
    full = None
    if wide:
        wide.sort()
        index = torch.tensor(wide, device=dev)
        full = (index, *filtered(logits if len(wide) == n else logits[index], [params[i] for i in wide], for_draw=True))
    u = uniforms(generators, dev)
    if full is None and not plain and len(narrow) == 1 and narrow[0][1]:  # the usual batch: one top-k, every row narrow
        _, _, ids, weights = narrow[0]
        return ids.gather(1, draw_with(weights, None, u).unsqueeze(1)).squeeze(1)
    chosen = torch.empty(n, dtype=torch.long, device=dev)
    if full is not None:
        index, probs, keep = full
        chosen[index] = draw_with(probs, keep, u[index])
    if plain:
        index = torch.tensor(plain, device=dev)
        chosen[index] = _draw_at_temperature(logits[index], [params[i] for i in plain], u[index])
    for rows, _, ids, weights in narrow:
        if rows:
            index = torch.tensor(rows, device=dev)
            chosen[index] = ids.gather(1, draw_with(weights, None, u[index]).unsqueeze(1)).squeeze(1)
    return chosen


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams | None],
    generators: list[torch.Generator | None],
    history: list[Sequence[int]],
    logprobs: bool = True,
    generated: list[list[int]] | None = None,
    grammars: list[grammar_masks.RowGrammar | None] | None = None,
    argmax: torch.Tensor | None = None,
) -> Sampled:
    """Pick one token per row of `logits` `[N, vocab]`.

    `history` (each row's sequence so far) feeds the repetition penalty, `generated` (the tokens the
    row sampled) the presence and frequency penalties; a caller that passes no `generated` has them
    count over `history`. A row's grammar (`grammars[i]`, see `grammar.py`) masks the tokens it cannot take
    after the adjustments, and takes the chosen token once every row has one; rows without one are untouched. `logprobs=False` skips the chosen tokens' log-probabilities (None) unless a
    row asks for top ones. Log-probabilities are the model's, before any adjustment. `argmax`: each row's
    `greedy_tokens` of these `logits`, where the caller already has them (a replayed step's head picked them).
    """
    params = [p or GREEDY for p in params]
    if not logprobs and grammars is None and all(p.greedy and not p.logprobs and not p.adjusts_logits for p in params):
        # every row greedy and nothing to adjust or report: each row's argmax, read as the head wrote it (one pass,
        # no fp32 copy; the same index as `max(-1).indices` of the fp32 logits, NaN and ties included)
        ids = greedy_tokens(logits) if argmax is None else argmax
        if ids is not None:
            return Sampled(ids.tolist(), [None] * len(params), [None] * len(params))
    logits = logits.float()
    vocab = logits.shape[1]
    wanted = [min(p.logprobs or 0, vocab) for p in params]  # asking for more than the vocabulary gets all of it
    # logprob of the pick = logit - logsumexp: avoids materialising a full log-softmax every step
    normaliser = torch.logsumexp(logits, dim=-1) if logprobs or max(wanted) > 0 else None
    raw = logits
    # Top log-probabilities come before the draw, so whatever raises here (say, a row's bad
    # parameters) raises before any row's generator advances: a retry row by row then draws the
    # same numbers a seeded request would have drawn in the batch.
    tops: list[list[tuple[int, float]] | None] = [None] * len(params)
    if max(wanted) > 0:
        values, ids = raw.topk(max(wanted), dim=-1)
        values = values - normaliser.unsqueeze(1)
        for i, k in enumerate(wanted):
            if k:
                tops[i] = list(zip(ids[i, :k].tolist(), values[i, :k].tolist(), strict=True))
    logits = adjust_logits(logits, params, history, history if generated is None else generated)
    if grammars is not None:
        logits = grammar_masks.apply_masks(logits, grammars)
    stochastic = [i for i, p in enumerate(params) if not p.greedy]
    if len(stochastic) == len(params):
        chosen = pick(logits, params, generators)
    else:
        # the argmax kernel on CPU; elsewhere max's indices: the same first-maximum (and NaN-first) rule as argmax,
        # ~2.8x faster on CPU (32 x 49,152 fp32 logits: 0.44 vs 1.22 ms, 2 threads)
        chosen = greedy_tokens(logits)
        if chosen is None:
            chosen = logits.max(-1).indices
        if stochastic:
            rows = torch.tensor(stochastic, device=logits.device)
            chosen[rows] = pick(logits[rows], [params[i] for i in stochastic], [generators[i] for i in stochastic])
    chosen_logprobs: list[float | None] = [None] * len(params)
    if normaliser is not None:
        chosen_logprobs = (raw.gather(1, chosen.unsqueeze(1)).squeeze(1) - normaliser).tolist()
    tokens = chosen.tolist()
    if grammars is not None:  # last: nothing after it raises, so a retry row by row never feeds a matcher twice
        grammar_masks.advance(grammars, tokens)
    return Sampled(tokens, chosen_logprobs, tops)
