"""Work off the event loop: the server's one bounded thread pool, started whole, and large JSON bodies parsed in it.

Everything the routes hand to `asyncio.to_thread` (media decode, schema and tool checks, message building) runs in
the loop's default executor. `install_pool` makes that a pool of `MSTAR_API_THREADS` threads (Python's own default
size unless set) whose threads all start at once, before the server takes requests: Python's executor starts a
thread on the submit that needs it, and `Thread.start` waits for the new thread to run, so on a busy machine each
such submit held the loop for a scheduling delay (0.1-0.24 s seen under the grammar stress).

A thread only frees the loop while the work in it lets go of the interpreter: one long C call (a JSON parse, a
base64 decode of megabytes) holds the GIL, and so the loop, for its whole length wherever it runs. Such work is made
cheaper or cut into pieces (`b64decode_pieces`) as well as moved. Small inputs stay inline: below `LARGE_BYTES` the
hop to a thread costs more than the work.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import ctypes.util
import json
import os
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute

from mstar_core.strict import positive_number

#: The scope key where the guard middleware (`mstar_core.api.server.middleware`) leaves the body it read.
BODY_KEY = "mstar.body"
#: Bodies and texts from this size go to the pool (a JSON parse of 256 KB takes ~1-2 ms here).
LARGE_BYTES = 256 * 1024
#: Base64 decoded this many characters at a time: each piece holds the GIL ~1 ms, so the loop gets its turns.
B64_PIECE = 1 << 20
THREADS_ENV = "MSTAR_API_THREADS"


def pool_size() -> int:
    """Threads in the pool: `MSTAR_API_THREADS`, else what Python's own executor would use (CPUs + 4, at most 32)."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        return int(positive_number(raw, THREADS_ENV, int))
    return min(32, (os.cpu_count() or 1) + 4)


#: glibc's mallopt parameter for the most malloc arenas (malloc.h), and the cap the server sets.
M_ARENA_MAX, ARENAS = -8, 2


def share_arenas() -> bool:
    """Cap glibc's malloc arenas (`ARENAS`), so the pool's threads share them instead of each keeping its own.

    The serving process keeps up to 256 MiB of freed heap per arena (`mstar_core.runtime.host_memory`: the device
    thread's forwards reuse their pages), and glibc gives each new thread an arena of its own, up to 8 per core:
    work spread over the pool's threads left each holding what it last decoded (RSS +722 MB after chaos_media's
    stress with the pool started whole, +311 MB with two arenas). Only glibc has mallopt; `MALLOC_ARENA_MAX` in the
    environment, or `MSTAR_MALLOC_TUNING=0`, leaves malloc as it is. True when applied."""
    if os.environ.get("MSTAR_MALLOC_TUNING", "1") == "0" or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to cap
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, ARENAS))


def release_freed_memory() -> None:
    """Hand freed heap back to the kernel (glibc's malloc_trim), after work that freed a lot at once (a realtime
    session's decoded media): arenas keep up to 256 MiB free otherwise. A few milliseconds; call it off the loop."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def install_pool(loop: asyncio.AbstractEventLoop, threads: int | None = None) -> ThreadPoolExecutor:
    """Make a pool of `threads` threads the loop's default executor, every thread started now (their malloc arenas
    shared: `share_arenas`)."""
    share_arenas()
    threads = threads or pool_size()
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mstar-off-loop")
    gate = threading.Barrier(threads)
    # each task waits for the others, so no thread is idle when the next is submitted: every submit starts one
    started = [executor.submit(gate.wait, 60) for _ in range(threads)]
    for future in started:
        future.result()
    loop.set_default_executor(executor)
    return executor


async def off_loop_when(needed: bool, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in the pool when `needed` (the input can be large), else here: a thread hop costs a
    request more than the work it saves when there is nothing to walk (no schema, no tools)."""
    if needed:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def loads(body: bytes | str) -> Any:
    """JSON exactly as Python's parser reads it, at orjson's speed where the two agree. orjson refuses NaN and
    Infinity literals, numbers past a double and lone surrogates, and reads integers past 64 bits as floats: any of
    those sends the body to `json.loads`, which decides (a float of integral value past 2**63 may have been such
    an integer; checking the parsed values is Python code, so a thread running it lets the loop have its turns)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)
    return json.loads(body) if _maybe_big_int(parsed) else parsed


_INT64 = float(2**63)


def _maybe_big_int(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float) and abs(item) >= _INT64 and item.is_integer():
            return True
    return False


async def parse_large_json(request: Any) -> None:
    """A large JSON body parsed in the pool before FastAPI reads it (it caches `request._json` and reuses it).

    Small bodies are left to FastAPI, parsed on the loop as before. A body that is not JSON raises the error FastAPI
    raises for it (a 400 naming the position), without a second parse on the loop."""
    if request.method not in ("POST", "PUT", "PATCH") or _length(request) < LARGE_BYTES:
        return
    content_type = request.headers.get("content-type", "")
    if content_type and "json" not in content_type.split(";", 1)[0].lower():
        return  # a form or an upload: not parsed as JSON
    body = request.scope.get(BODY_KEY)  # what the guard middleware read: Starlette's body() would copy it
    if body is None:
        body = await request.body()
    else:
        request._body = body  # (FastAPI reads it from here too)
    if len(body) < LARGE_BYTES:
        return
    try:
        request._json = await asyncio.to_thread(loads, body)
    except json.JSONDecodeError as exc:
        from fastapi.exceptions import RequestValidationError

        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except (UnicodeDecodeError, RecursionError):
        return  # FastAPI answers these as it always has


def _length(request: Any) -> int:
    try:
        return int(request.headers.get("content-length", "0"))
    except ValueError:
        return 0


#: Characters of a string encoded to JSON at a time by `json_text` (one C call each: ~1 ms).
JSON_PIECE = 1 << 20


def json_text(value: Any) -> str:
    """`json.dumps(value, ensure_ascii=False)`, the same text, with strings of `JSON_PIECE` characters or more
    encoded a piece at a time: one call for a 12 MB tool description holds the GIL (and so the loop, whichever
    thread runs it) for its whole length. Containers are walked here (they are small: their size is bounded)."""
    if isinstance(value, str):
        if len(value) < JSON_PIECE:
            return json.dumps(value, ensure_ascii=False)
        pieces = (json.encoder.encode_basestring(value[at:at + JSON_PIECE])[1:-1]
                  for at in range(0, len(value), JSON_PIECE))
        return '"' + "".join(pieces) + '"'
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{json_text(k)}: {json_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(json_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def b64decode_pieces(text: str | bytes, *, validate: bool = False) -> bytes:
    """`base64.b64decode(text, validate=validate)` (the same bytes, the same errors) in pieces of `B64_PIECE`
    characters, so that a decode of megabytes in a thread lets the loop run between pieces. Pieces are decoded
    strictly; text they refuse (line breaks, stray characters, bad padding) is decoded whole, as it always was."""
    if isinstance(text, str):
        try:
            data = text.encode("ascii")
        except UnicodeEncodeError:
            return base64.b64decode(text, validate=validate)  # its own error for text that is not ASCII
    else:
        data = bytes(text)
    if len(data) <= B64_PIECE:
        return base64.b64decode(data, validate=validate)
    view = memoryview(data)
    try:
        return b"".join(base64.b64decode(view[at:at + B64_PIECE], validate=True)
                        for at in range(0, len(data), B64_PIECE))
    except binascii.Error:
        return base64.b64decode(data, validate=validate)

class OffLoopJsonRoute(APIRoute):
    """A FastAPI route whose large JSON bodies are parsed in the pool (`parse_large_json`), not on the loop."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            await parse_large_json(request)
            return await handler(request)

        return handle


def json_router() -> APIRouter:
    """An APIRouter whose routes parse large JSON bodies off the loop."""
    return APIRouter(route_class=OffLoopJsonRoute)
