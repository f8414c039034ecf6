"""Compiled `GrammarSpec`s: compiled in a bounded pool of killable processes (`pool.py`), cached by digest.

`compiled()` is what an engine calls (blocking; a hit is a dict lookup). `compile_bounded()` is what the HTTP
edge awaits, off the event loop: the same spec compiles once however many requests wait for it, a full queue is a
503, a compile past its budget is killed and a 400, and a request that goes away (refused, cancelled, disconnected)
cancels the compile if no other request waits for it. Either way the grammar comes back from its process as
xgrammar's JSON serialisation and is rebuilt here against this process's `TokenizerInfo` for the same vocabulary
(the same masks bit for bit), then cached, so the engine finds what the edge compiled.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from typing import Any

from mstar_core.errors import RequestError
from mstar_core.grammar import limits
from mstar_core.grammar.pool import CompileJob, CompilePool
from mstar_core.grammar.spec import GrammarSpec
from mstar_core.grammar.vocab import GrammarVocab

#: Compiled grammars kept (all vocabularies together); each holds its token-mask cache, tens of KB to a few MB.
MAX_CACHED = 256

_lock = threading.Lock()
_infos: dict[str, Any] = {}
_cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
_pool: CompilePool | None = None
#: Milliseconds of the last compiles (in their process), for benchmarks and /metrics-style reporting.
compile_times_ms: list[float] = []
#: Milliseconds of the last round trips (queue wait excluded: sent, compiled, received and rebuilt here).
round_trip_ms: list[float] = []
#: Requests of this process waiting for a compile now (the server's drain counts them as in flight).
_waiting = 0


def waiting() -> int:
    """Requests waiting for a compile now: each is in flight though the engine has not seen it yet."""
    return _waiting


#: Set when the server's drain ran out of time: compiles still waited for are given up (a 503 each).
_shutting_down = False


def give_up_waiting() -> None:
    """The server stops: every request still waiting for a compile gets a 503 at once (its compile is cancelled,
    its process killed) instead of holding the shutdown for another graceful timeout."""
    global _shutting_down
    _shutting_down = True


async def _until_shutdown() -> None:
    while not _shutting_down:
        await asyncio.sleep(0.1)


def pool() -> CompilePool:
    """The process's compile pool, made on first use with the operator's limits."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = CompilePool()
        return _pool


def warm(vocab: GrammarVocab, background: bool = True) -> None:
    """Get ready to compile for `vocab`: the pool's processes start, and this process's `TokenizerInfo` (which
    rebuilds their grammars) is made, in the background or (`background=False`) before this returns.

    xgrammar builds a `TokenizerInfo` holding the GIL (0.7-1.5 s for a 49k vocabulary on a 2-core box): a server
    waits for it before it says it is ready, else its first requests' steps wait behind it for seconds."""
    pool().warm()
    if not background:
        _tokenizer_info(vocab, _fingerprint(vocab))
        return
    threading.Thread(target=lambda: _tokenizer_info(vocab, _fingerprint(vocab)), daemon=True,
                     name="mstar-grammar-warm").start()


def _tokenizer_info(vocab: GrammarVocab, key: str) -> Any:
    import xgrammar as xgr

    with _lock:
        info = _infos.get(key)
    if info is None:
        info = xgr.TokenizerInfo(list(vocab.token_bytes), vocab_type=xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.stop_ids))
        with _lock:
            info = _infos.setdefault(key, info)
    return info


_fingerprints: dict[int, tuple[GrammarVocab, str]] = {}


def _fingerprint(vocab: GrammarVocab) -> str:
    """The vocabulary's fingerprint, computed once per object (hashing 49k tokens is ~10 ms)."""
    hit = _fingerprints.get(id(vocab))
    if hit is not None and hit[0] is vocab:
        return hit[1]
    fp = vocab.fingerprint
    _fingerprints[id(vocab)] = (vocab, fp)
    return fp


def cached(vocab: GrammarVocab, spec: GrammarSpec) -> Any:
    """The compiled grammar if it is cached, else None."""
    key = (_fingerprint(vocab), spec.digest)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
        return hit


def _check_size(spec: GrammarSpec, param: str) -> None:
    size, most = len(spec.source.encode()), limits.max_grammar_bytes()
    if size > most:
        raise RequestError(f"'{param}': the grammar is {size} bytes; at most {most} are accepted (fewer or smaller "
                           "schemas)", param=param)


def _submit(vocab: GrammarVocab, spec: GrammarSpec, budget_s: float | None, param: str) -> CompileJob:
    _check_size(spec, param)
    budget = budget_s if budget_s is not None else limits.compile_timeout_s()
    return pool().submit((_fingerprint(vocab), spec.digest), vocab, spec, budget, param=param)


def _finish(vocab: GrammarVocab, job: CompileJob) -> Any:
    """The job's grammar rebuilt here (once per job however many wait for it) and cached."""
    import xgrammar as xgr

    text, ms = job.future.result()
    with _lock:
        hit = _cache.get(job.key)
    if hit is not None:
        return hit
    grammar = xgr.CompiledGrammar.deserialize_json(text, _tokenizer_info(vocab, job.key[0]))
    with _lock:
        compile_times_ms.append(ms)
        del compile_times_ms[:-1000]
        _cache[job.key] = grammar
        while len(_cache) > MAX_CACHED:
            _cache.popitem(last=False)
    return grammar


def _named(exc: RequestError, param: str) -> RequestError:
    """`exc` with its message naming `param`, its status and Retry-After kept."""
    if str(exc).startswith(f"'{param}'"):
        return exc
    named = type(exc).__new__(type(exc))
    RequestError.__init__(named, f"'{param}': {exc}", status=exc.status, param=param)
    named.__dict__.update({k: v for k, v in exc.__dict__.items() if k not in ("param",)})
    return named


def compiled(vocab: GrammarVocab, spec: GrammarSpec, param: str = "grammar") -> Any:
    """The xgrammar `CompiledGrammar` for `spec` over `vocab` (compiled now, in the pool, unless cached); a spec the
    library refuses or that runs past its budget is a `RequestError` (400), a full pool one with status 503."""
    hit = cached(vocab, spec)
    if hit is not None:
        return hit
    job = _submit(vocab, spec, None, param)
    try:
        job.future.result()
        return _finish(vocab, job)
    except RequestError as exc:
        raise _named(exc, param) from None
    finally:
        pool().release(job)


async def compile_bounded(vocab: GrammarVocab, spec: GrammarSpec, timeout: float | None = None,
                          param: str = "response_format") -> Any:
    """`compiled()` off the event loop; a compile longer than `timeout` seconds (default the operator's budget,
    MSTAR_GRAMMAR_COMPILE_TIMEOUT) is killed and a 400 naming `param`; a full pool a 503 with Retry-After. If this
    coroutine is cancelled (its request went away) the compile is cancelled too, unless another request waits."""
    hit = cached(vocab, spec)
    if hit is not None:
        return hit
    try:
        job = _submit(vocab, spec, timeout, param)
    except RequestError as exc:
        raise _named(exc, param) from None
    global _waiting
    _waiting += 1  # (the event loop's thread only)
    t0 = time.perf_counter()
    compiled = None
    try:
        compiled, shutdown = asyncio.wrap_future(_unshared(job)), asyncio.ensure_future(_until_shutdown())
        try:
            await asyncio.wait({compiled, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            shutdown.cancel()
        if not compiled.done():
            compiled.cancel()
            raise RequestError("the server is shutting down before this request's grammar compiled; retry it",
                               status=503, param=param)
        compiled.result()
        grammar = await asyncio.to_thread(_finish, vocab, job)  # rebuilding a large grammar takes milliseconds
    except RequestError as exc:
        raise _named(exc, param) from None
    finally:
        if compiled is not None and not compiled.done():
            # this request went away mid-compile: its own future is dropped before `release` cancels the job, so
            # the cancelled compile's error has no future left to land in unread
            compiled.cancel()
        _waiting -= 1
        pool().release(job)
    round_trip_ms.append((time.perf_counter() - t0) * 1e3)
    del round_trip_ms[:-1000]
    return grammar


def _unshared(job: CompileJob) -> Any:
    """A future of this waiter's own that follows the job's: cancelling it (the request went away) leaves the
    shared one alone, and `release` decides whether the compile is cancelled."""
    from concurrent.futures import Future, InvalidStateError

    mine: Future = Future()

    def follow(done: Future) -> None:
        try:
            if done.cancelled():
                mine.cancel()
            elif done.exception() is not None:
                mine.set_exception(done.exception())
            else:
                mine.set_result(done.result())
        except InvalidStateError:  # this waiter was cancelled first
            pass

    job.future.add_done_callback(follow)
    return mine
