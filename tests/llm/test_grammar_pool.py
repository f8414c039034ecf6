"""Grammar compiles in killable processes: bounded queue (503), budget (killed, 400), cancellation (worker freed),
masks bit-exact after the process round trip, and schema checks that never recurse on a request's nesting."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")

from mstar_core.errors import RequestError  # noqa: E402
from mstar_core.grammar import GrammarSpec, GrammarVocab  # noqa: E402
from mstar_core.grammar import compile as gc  # noqa: E402
from mstar_core.grammar.check import check_json_schema  # noqa: E402
from mstar_core.grammar.pool import CompileCancelled, CompilePool, CompileQueueFull  # noqa: E402

PIECES = tuple([b"", b"{", b"}", b'"', b"a", b"b", b":", b"1", b"2", b" ", b",", b"[", b"]", b"true", b"x"])
VOCAB = GrammarVocab(PIECES, (0,), len(PIECES))


def _nest(wrap, n, leaf):
    for _ in range(n):
        leaf = wrap(leaf)
    return leaf


def _slow_schema(n: int) -> str:
    """Optional properties make xgrammar's JSON-schema converter slow (combinations of which are present)."""
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})


@pytest.mark.parametrize("schema", [
    _nest(lambda s: {"type": "object", "properties": {"a": s}}, 200, {"type": "string"}),
    _nest(lambda s: {"anyOf": [s]}, 2000, {}),
    _nest(lambda s: {"items": s}, 5000, {}),
    {"enum": [_nest(lambda s: [s], 5000, [])]},
    {"type": "string", "pattern": "(" * 2000 + "a" + ")" * 2000},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5001)}},
])
def test_deep_long_or_large_schemas_are_refused_before_any_recursion(schema):
    """Each is a RequestError (a 400) naming the field; none reaches jsonschema's recursive check."""
    with pytest.raises(RequestError) as err:
        check_json_schema(schema, "response_format.json_schema.schema")
    assert err.value.status == 400 and err.value.param == "response_format.json_schema.schema"
    assert "nests" in str(err.value) or "properties" in str(err.value)


def test_schema_limits_the_operator_sets(monkeypatch):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}
    check_json_schema(schema, "s")
    monkeypatch.setenv("MSTAR_GRAMMAR_MAX_PROPERTIES", "10")
    with pytest.raises(RequestError, match="more than 10 properties"):
        check_json_schema(schema, "s")
    monkeypatch.setenv("MSTAR_GRAMMAR_MAX_SCHEMA_BYTES", "100")
    monkeypatch.delenv("MSTAR_GRAMMAR_MAX_PROPERTIES")
    with pytest.raises(RequestError, match="at most 100 are accepted"):
        check_json_schema(schema, "s")
    monkeypatch.delenv("MSTAR_GRAMMAR_MAX_SCHEMA_BYTES")
    # within the limits: 32 levels, and parentheses inside a character class or escaped are not groups
    check_json_schema(_nest(lambda s: {"type": "object", "properties": {"a": s}}, 32, {"type": "string"}), "s")
    check_json_schema({"type": "string", "pattern": r"[(]" * 50 + r"\(" * 50 + "(a(b))"}, "s")


def test_budget_kills_the_compile_and_the_next_one_is_prompt():
    pool = CompilePool(workers=1, queue_size=2)
    slow = pool.submit(("v", "slow"), VOCAB, GrammarSpec("json_schema", _slow_schema(3000)), budget_s=1.0)
    with pytest.raises(RequestError, match="did not compile within 1 s"):
        slow.future.result(timeout=200)  # (the first job also starts the zygote: seconds on a loaded machine)
    assert pool.killed == 1
    t0 = time.monotonic()
    ok = pool.submit(("v", "ok"), VOCAB, GrammarSpec("json_object"), budget_s=30.0)
    text, _ms = ok.future.result(timeout=30)
    assert time.monotonic() - t0 < 5 and json.loads(text)


def test_full_queue_is_a_503_with_retry_after_and_cancelling_frees_the_worker():
    pool = CompilePool(workers=1, queue_size=1)
    running = pool.submit(("v", "a"), VOCAB, GrammarSpec("json_schema", _slow_schema(3000)), budget_s=300.0)
    deadline = time.monotonic() + 200
    while pool._waiting and time.monotonic() < deadline:  # the worker took it (the zygote may still be starting)
        time.sleep(0.05)
    queued = pool.submit(("v", "b"), VOCAB, GrammarSpec("json_schema", _slow_schema(3001)), budget_s=300.0)
    with pytest.raises(CompileQueueFull) as full:
        pool.submit(("v", "c"), VOCAB, GrammarSpec("regex", "x"), budget_s=300.0, param="tools")
    assert full.value.status == 503 and full.value.retry_after_s == 300.0 and full.value.param == "tools"
    joined = pool.submit(("v", "a"), VOCAB, GrammarSpec("json_schema", _slow_schema(3000)), budget_s=300.0)
    assert joined is running  # the same grammar in flight is joined, not queued again
    pool.release(queued)  # a queued job whose request went away leaves the queue at once
    pool.release(joined)
    assert not running.future.done()  # one waiter is left
    pool.release(running)  # the last waiter left: the running compile's process is killed
    deadline = time.monotonic() + 10
    while pool.killed == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.killed == 1 and isinstance(running.future.exception(timeout=10), CompileCancelled)
    t0 = time.monotonic()
    text, _ = pool.submit(("v", "d"), VOCAB, GrammarSpec("regex", "x+"), budget_s=30.0).future.result(timeout=30)
    assert time.monotonic() - t0 < 5 and text


def test_cancelled_request_cancels_its_compile(monkeypatch):
    """compile_bounded's task cancelled (a disconnect) releases the job: nobody else waits, so it is killed."""
    pool = CompilePool(workers=1, queue_size=2)
    monkeypatch.setattr(gc, "_pool", pool)

    async def go():
        task = asyncio.create_task(gc.compile_bounded(VOCAB, GrammarSpec("json_schema", _slow_schema(2999)),
                                                      timeout=300))
        deadline = time.monotonic() + 200
        while pool.busy() == 0 or pool._waiting:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while pool.killed == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.killed == 1 and pool.busy() == 0


def test_masks_are_bit_exact_after_the_round_trip(tiny):
    """The grammar rebuilt from its process's serialisation masks every step exactly as one compiled here."""
    from mstar_core.grammar import worker

    vocab = tiny.extras["grammar_vocab"]
    info = xgr.TokenizerInfo(list(vocab.token_bytes), vocab_type=xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                             stop_token_ids=list(vocab.stop_ids))
    here = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
              "required": ["ok", "n"], "additionalProperties": False}
    specs = [GrammarSpec("json_schema", json.dumps(schema)), GrammarSpec("json_object"),
             GrammarSpec("regex", "[a-c]+@[0-9]{2,4}")]
    texts = ['{"ok": true, "n": 12, "tags": ["x", "y"]}', '{"a": [1, {"b": null}]}', "abca@123"]
    for spec, text in zip(specs, texts, strict=True):
        ours = xgr.GrammarMatcher(gc.compiled(vocab, spec))
        ref = xgr.GrammarMatcher(worker.build(here, spec.kind, spec.source))
        tokens = [next(i for i, p in enumerate(vocab.token_bytes) if p == c.encode()) for c in text]
        for token in tokens:
            a, b = xgr.allocate_token_bitmask(1, vocab.vocab_size), xgr.allocate_token_bitmask(1, vocab.vocab_size)
            ours.fill_next_token_bitmask(a, 0)
            ref.fill_next_token_bitmask(b, 0)
            assert bool((a == b).all())
            assert ours.accept_token(token) and ref.accept_token(token)
    assert gc.cached(vocab, specs[0]) is gc.compiled(vocab, specs[0])  # reused, not compiled again


def test_a_compile_past_its_memory_limit_is_killed(monkeypatch):
    """A limit below what any compile process holds (the zygote's pages it shares): killed at the first look."""
    pool = CompilePool(workers=1, queue_size=1)
    pool.submit(("v", "warm"), VOCAB, GrammarSpec("regex", "w"), budget_s=30.0).future.result(timeout=200)
    proc = pool._procs[0]
    assert proc is not None and 20 < proc.resident_mb() < 2048  # what an idle compile process holds
    monkeypatch.setenv("MSTAR_GRAMMAR_COMPILE_MEMORY_MB", "1")
    job = pool.submit(("v", "big"), VOCAB, GrammarSpec("json_schema", _slow_schema(3000)), budget_s=300.0)
    with pytest.raises(RequestError, match="more than 1 MB"):
        job.future.result(timeout=30)
    assert pool.killed == 1


def test_a_waited_warm_up_leaves_the_vocabularys_tokenizer_info_built(monkeypatch):
    """The server waits for it before it is ready (xgrammar builds it holding the GIL, which held the first
    requests' steps up by seconds when it ran in the background)."""
    class NoPool:
        def warm(self):
            pass

    monkeypatch.setattr(gc, "pool", lambda: NoPool())
    vocab = GrammarVocab(PIECES + (b"warm",), (0,), len(PIECES) + 1)
    gc.warm(vocab, background=False)
    assert gc._fingerprint(vocab) in gc._infos
