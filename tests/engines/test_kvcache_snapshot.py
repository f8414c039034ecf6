"""Moving a request's cache between engines (what per-walk placement does between workers)."""

from __future__ import annotations

import pytest
import torch
from mstar_kvcache import CacheSnapshot

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from mstar_core.sampling import SamplingParams
from mstar_core.wire import LoopValues
from mstar_core.wire.codec import decode, encode
from tests.engines.driver import make_engine

PROMPT = list(range(3, 24))  # 21 tokens: five full pages of 4 and a partial one


def _run(engine, rid, first_input, steps, sampling=None):
    """Feed `first_input`, then each sampled token, for `steps` calls; the tokens, logits and the last token."""
    extra = {} if sampling is None else {"sampling": sampling}
    tokens, logits, feed = [], [], first_input
    for _ in range(steps):
        engine.add(Invocation(rid, "lm", {"input_ids": feed, **extra}, {}))
        ((_, out),) = engine.step()
        if isinstance(out, BaseException):
            raise out
        tokens.append(out["next_token"])
        logits.append(out["logits"])
        feed = out["next_token"]
    return tokens, logits, feed


def _over_the_wire(snapshot: CacheSnapshot) -> CacheSnapshot:
    frames = encode(LoopValues(request_id="r", loop=0, call=0, outputs={"cache": snapshot.to_plain()}))
    return CacheSnapshot.from_plain(decode(frames).outputs["cache"])


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=100)])
def test_a_moved_cache_continues_exactly_as_if_it_had_stayed(llama_pair, sampling):
    _, ours = llama_pair
    here = make_engine(ours, page_size=4, num_pages=32)
    _, _, last = _run(here, "r", PROMPT, 6, sampling)  # prefill + 5 decode steps here
    snapshot = here.export_cache("r")
    assert snapshot.kv.shape[2] == len(PROMPT) + 5 and here.pool.num_used == 7  # ceil(26 / 4); exporting frees nothing

    there = make_engine(ours, page_size=4, num_pages=32)
    there.import_cache("r", _over_the_wire(snapshot))
    assert there.pool.num_used == 7  # the imported tokens fill pages as if computed there
    moved, moved_logits, _ = _run(there, "r", last, 20, sampling)
    stayed, stayed_logits, _ = _run(here, "r", last, 20, sampling)
    assert moved == stayed
    torch.testing.assert_close(torch.stack(moved_logits), torch.stack(stayed_logits), atol=1e-5, rtol=1e-5)
    for engine in (here, there):
        engine.release("r")
        assert engine.pool.num_used == 0


def test_export_and_import_refuse_what_they_cannot_do(llama_pair):
    _, ours = llama_pair
    engine = make_engine(ours, page_size=4, num_pages=32)
    with pytest.raises(RequestError, match="no cache label 'main'"):
        engine.export_cache("nobody")
    engine.add(Invocation("r", "lm", {"input_ids": PROMPT}, {}))
    with pytest.raises(RequestError, match="mid-call"):
        engine.export_cache("r")
    engine.step()
    snapshot = engine.export_cache("r")
    with pytest.raises(RequestError, match="already exists"):
        engine.import_cache("r", snapshot)
    small = make_engine(ours, page_size=4, num_pages=4)
    with pytest.raises(RequestError, match="needs 6 KV pages") as too_big:
        small.import_cache("r", snapshot)
    assert too_big.value.status == 413 and small.pool.num_used == 0
    wrong = CacheSnapshot(label="main", tokens=snapshot.tokens, generated=[], kv=snapshot.kv[:1])
    with pytest.raises(RequestError, match="KV shape"):
        make_engine(ours, page_size=4, num_pages=32).import_cache("q", wrong)
    with pytest.raises(RequestError, match="format"):
        CacheSnapshot.from_plain({"format": 99})
