"""Compiling `GrammarSpec`s with xgrammar: one compiler per vocabulary, compiled grammars cached by digest.

`compiled()` is what an engine calls (blocking; a hit is a dict lookup). `compile_bounded()` is what the HTTP
edge awaits: the compile runs on a small thread pool off the event loop, the same spec compiles once however
many requests wait for it, and one that takes longer than the limit is a 400 (the compile itself finishes in
the background and is cached, since xgrammar cannot be interrupted).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mstar_core.errors import RequestError
from mstar_core.grammar.spec import GrammarSpec
from mstar_core.grammar.vocab import GrammarVocab

#: Compiled grammars kept (all vocabularies together); each holds its token-mask cache, tens of KB to a few MB.
MAX_CACHED = 256
#: Compiles running at once: more would only share the same two cores and all miss their limit.
COMPILE_THREADS = 2
#: Seconds a request waits for its grammar to compile before it is refused (MSTAR_GRAMMAR_COMPILE_TIMEOUT).
DEFAULT_TIMEOUT = 10.0

_lock = threading.Lock()
_compilers: dict[str, Any] = {}
_cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
_inflight: dict[tuple[str, str], Future] = {}
_pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="mstar-grammar")
#: (kind, milliseconds) of the last compiles, for benchmarks and /metrics-style reporting.
compile_times_ms: list[float] = []


def _compiler(vocab: GrammarVocab) -> Any:
    import xgrammar as xgr

    key = _fingerprint(vocab)
    with _lock:
        compiler = _compilers.get(key)
    if compiler is None:
        info = xgr.TokenizerInfo(list(vocab.token_bytes), vocab_type=xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                                 stop_token_ids=list(vocab.stop_ids))
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        with _lock:
            compiler = _compilers.setdefault(key, compiler)
    return compiler


_fingerprints: dict[int, tuple[GrammarVocab, str]] = {}


def _fingerprint(vocab: GrammarVocab) -> str:
    """The vocabulary's fingerprint, computed once per object (hashing 49k tokens is ~10 ms)."""
    hit = _fingerprints.get(id(vocab))
    if hit is not None and hit[0] is vocab:
        return hit[1]
    fp = vocab.fingerprint
    _fingerprints[id(vocab)] = (vocab, fp)
    return fp


def _build(compiler: Any, spec: GrammarSpec) -> Any:
    import xgrammar as xgr

    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "structural_tag":
        return compiler.compile_structural_tag(spec.source)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(xgr.Grammar.from_ebnf(spec.source))
    raise RequestError(f"unknown grammar kind {spec.kind!r}", param="grammar")


def compiled(vocab: GrammarVocab, spec: GrammarSpec) -> Any:
    """The xgrammar `CompiledGrammar` for `spec` over `vocab` (compiled now unless cached); a spec the library
    refuses is a `RequestError` (400) quoting its reason."""
    import time

    key = (_fingerprint(vocab), spec.digest)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    t0 = time.perf_counter()
    try:
        grammar = _build(_compiler(vocab), spec)
    except RequestError:
        raise
    except Exception as exc:  # xgrammar's RuntimeError / InvalidJSONError carry the reason
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise RequestError(f"the {spec.kind.replace('_', ' ')} cannot be compiled: {reason}", param="grammar") from None
    compile_times_ms.append((time.perf_counter() - t0) * 1e3)
    del compile_times_ms[:-1000]
    with _lock:
        _cache[key] = grammar
        while len(_cache) > MAX_CACHED:
            _cache.popitem(last=False)
    return grammar


def _submit(vocab: GrammarVocab, spec: GrammarSpec) -> Future:
    key = (_fingerprint(vocab), spec.digest)
    with _lock:
        future = _inflight.get(key)
        if future is None:
            future = _pool.submit(compiled, vocab, spec)
            _inflight[key] = future
            future.add_done_callback(lambda _f: _drop_inflight(key))
    return future


def _drop_inflight(key: tuple[str, str]) -> None:
    with _lock:
        _inflight.pop(key, None)


async def compile_bounded(vocab: GrammarVocab, spec: GrammarSpec, timeout: float | None = None,
                          param: str = "response_format") -> Any:
    """`compiled()` off the event loop; longer than `timeout` seconds (default `DEFAULT_TIMEOUT`, or the
    MSTAR_GRAMMAR_COMPILE_TIMEOUT variable) is a 400 naming `param`."""
    import os

    limit = timeout if timeout is not None else float(os.environ.get("MSTAR_GRAMMAR_COMPILE_TIMEOUT", DEFAULT_TIMEOUT))
    future = asyncio.wrap_future(_submit(vocab, spec))
    try:
        return await asyncio.wait_for(asyncio.shield(future), limit)
    except TimeoutError:
        raise RequestError(f"'{param}': the grammar did not compile within {limit:g} s; simplify the schema (fewer "
                           "or smaller maxLength / maxItems bounds, fewer alternatives)", param=param) from None
    except RequestError as exc:
        raise RequestError(f"'{param}': {exc}", param=param) from None
