"""A compile process: vocabularies and grammar sources in, xgrammar's serialised `CompiledGrammar`s out.

It runs one compile at a time, and the server kills it when the compile's request is refused, cancelled or past
its budget: xgrammar cannot be interrupted inside a thread, but a process can always be killed. It is forked from
the zygote (`zygote.py`: xgrammar already imported there, so a new one starts in tens of milliseconds) and speaks
`protocol`'s frames over its socket, nothing pickled.
"""

from __future__ import annotations

import ctypes
import signal
import time
from typing import Any

import xgrammar as xgr  # imported once in the zygote: its forks start with it

from mstar_core.grammar import protocol

#: Vocabularies one process keeps (a server rarely serves more than a few tokenizers).
MAX_VOCABS = 4


def serve(conn: Any) -> None:
    """Answer frames on `conn` until the server closes it (or kills this process)."""
    die_with_parent()
    compilers: dict[str, Any] = {}
    while True:
        try:
            data = conn.recv_bytes(protocol.MAX_FRAME_BYTES)
        except (EOFError, OSError):
            return
        header, body = protocol.unframe(data)
        op = protocol.field(header, "op", str)
        if op == "vocab":
            if len(compilers) >= MAX_VOCABS:
                compilers.pop(next(iter(compilers)))
            compilers[protocol.field(header, "key", str)] = _compiler(header, body)
            conn.send_bytes(protocol.frame({"ok": True}))
        elif op == "compile":
            compiler = compilers.get(protocol.field(header, "key", str))
            kind = protocol.field(header, "kind", str)
            conn.send_bytes(_compile(compiler, kind, body.decode()))
        else:
            raise protocol.ProtocolError(f"unknown op {op!r}")


def die_with_parent() -> None:
    """Killed when the parent ends (a fork with the zygote, the zygote with the server): no compile outlives its
    server, whatever it is doing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def _compiler(header: dict[str, Any], body: bytes) -> Any:
    info = xgr.TokenizerInfo(protocol.unpack_tokens(body), vocab_type=xgr.VocabType.RAW,
                             vocab_size=protocol.field(header, "vocab_size", int),
                             stop_token_ids=list(protocol.field(header, "stop_ids", list)))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def build(compiler: Any, kind: str, source: str) -> Any:
    """`source` of grammar `kind` compiled (what the server would have compiled in-process)."""
    if kind == "json_schema":
        return compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(source)
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "ebnf":
        return compiler.compile_grammar(xgr.Grammar.from_ebnf(source))
    raise ValueError(f"unknown grammar kind {kind!r}")


def _compile(compiler: Any, kind: str, source: str) -> bytes:
    if compiler is None:
        return protocol.frame({"ok": False, "error": "the vocabulary was not sent first"})
    t0 = time.perf_counter()
    try:
        grammar = build(compiler, kind, source)
    except Exception as exc:  # xgrammar's RuntimeError / InvalidJSONError carry the reason
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return protocol.frame({"ok": False, "error": reason})
    ms = (time.perf_counter() - t0) * 1e3
    return protocol.frame({"ok": True, "ms": ms}, grammar.serialize_json().encode())
