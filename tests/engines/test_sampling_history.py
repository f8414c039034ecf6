"""The repetition penalty over `TokenIds` mirrors: the same logits as over the lists, and a mirror never goes stale."""

from __future__ import annotations

import torch
from mstar_kvcache.answers import penalty_history
from mstar_kvcache.history import TokenIds
from mstar_kvcache.sampler import apply_repetition_penalty

from mstar_core.runtime.engine import Invocation
from mstar_core.sampling import SamplingParams
from tests.engines.driver import make_engine


def _penalised(logits: torch.Tensor, history, penalties) -> torch.Tensor:
    out = logits.clone()
    apply_repetition_penalty(out, history, penalties)
    return out


def test_mirrored_histories_penalise_exactly_as_lists():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 3
    cases = [
        [[3, 5, 5, 9], [0, 1, 2, 3, 4, 36], [7], [11, 12, 13, 11]],  # ragged
        [[3, 5, 5, 9], [1, 2, 3, 4], [7, 7, 8, 39], [11, 12, 13, 11]],  # equal lengths
    ]
    for history in cases:
        for penalties in ([1.3] * 4, [1.3, 1.0, 0.7, 1.3], [1.0, 1.0, 1.2, 1.0], [1.2, 1.2, 1.0, 1.2]):
            want = _penalised(logits, history, penalties)
            mirrored = [TokenIds().of(h) for h in history]
            assert torch.equal(_penalised(logits, mirrored, penalties), want)
            mixed = [TokenIds().of(h) if i % 2 else h for i, h in enumerate(history)]
            assert torch.equal(_penalised(logits, mixed, penalties), want)


def test_mirror_follows_appends_growth_and_shrinking():
    mirror, tokens = TokenIds(), [5, 6]
    assert mirror.of(tokens).tolist() == [5, 6]
    tokens.append(7)  # one id
    assert mirror.of(tokens).tolist() == [5, 6, 7]
    tokens.extend(range(100))  # several, past the first capacity
    assert mirror.of(tokens).tolist() == tokens
    del tokens[10:]  # shrank behind its back: copied again
    tokens.append(1)
    assert mirror.of(tokens).tolist() == tokens


def _lm_with_penalty(tiny_llama, **settings):
    _, model = tiny_llama
    return make_engine(model, num_pages=32, **settings)


def _run(engine, rid, ids, sampling, **options):
    engine.add(Invocation(rid, "lm", {"input_ids": ids, "sampling": sampling}, options))
    out = []
    while engine.has_work():
        out += engine.step()
    return out


def test_forks_and_rollbacks_never_read_a_stale_mirror(llama_pair):
    """A fork's mirror is its own, and a failed call's rolled-back tokens leave the mirror."""
    engine = _lm_with_penalty(llama_pair)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=8)
    _run(engine, "r", [1, 2, 3, 4], params)
    main = engine.seqs[("r", "main")]
    assert main.token_ids is not None and main.token_ids.of(main.tokens).tolist() == main.tokens
    _run(engine, "r", [9], params, cache_label="b", fork_from="main")
    fork = engine.seqs[("r", "b")]
    assert fork.token_ids is not main.token_ids
    assert fork.token_ids.of(fork.tokens).tolist() == fork.tokens
    engine.blocks.truncate(main, 2)
    assert main.token_ids is None
    main.tokens.extend([7, 8])
    assert penalty_history(main).tolist() == [1, 2, 7, 8]
