"""The off-loop pool and what runs in it (issue 50, item 4): large JSON bodies parsed in the pool as Python's parser
reads them, base64 decoded in pieces to the same bytes and errors, every pool thread started before requests, and
the loop watch naming what held the loop."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import os
import sys
import threading
import time

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from mstar_core.api.http import json_bodies, off_loop, pieces
from mstar_core.api.http.errors import install_error_handlers
from mstar_core.api.server.loop_watch import LoopWatch
from mstar_core.errors import ConfigError


@pytest.mark.parametrize("size", [0, 5, pieces.B64_PIECE // 4 * 3, pieces.B64_PIECE // 4 * 3 + 1,
                                  3 * pieces.B64_PIECE + 7])
def test_pieces_decode_to_the_same_bytes(size):
    raw = bytes(range(256)) * (size // 256) + bytes(size % 256)
    text = base64.b64encode(raw).decode()
    assert pieces.b64decode_pieces(text) == raw == pieces.b64decode_pieces(text.encode(), validate=True)


def test_pieces_keep_b64decodes_leniency_and_errors():
    raw = bytes(range(256)) * 20_000  # 5 MB: several pieces
    text = base64.b64encode(raw).decode()
    wrapped = "\n".join(text[i:i + 76] for i in range(0, len(text), 76))  # MIME lines: lenient decode skips them
    assert pieces.b64decode_pieces(wrapped) == base64.b64decode(wrapped) == raw
    for bad in (wrapped, text[:-1], text[:1000] + "=" + text[1001:], text[:5000] + "*" + text[5001:]):
        with pytest.raises(binascii.Error):
            base64.b64decode(bad, validate=True)
        with pytest.raises(binascii.Error):
            pieces.b64decode_pieces(bad, validate=True)
    with pytest.raises(ValueError):
        pieces.b64decode_pieces("é" * 2_000_000)


@pytest.mark.parametrize("doc", ['{"a": NaN, "b": -Infinity}', '{"big": 123456789012345678901234567890}',
                                 '{"s": "\\ud800"}', '{"x": [1, 2.5, "t", null, true], "x": {"k": "last"}}',
                                 '{"e": 1e400}', '{"n": [{"m": -9223372036854775809}, 1e20, 0.1, 18446744073709551615]}'])
def test_loads_reads_what_pythons_parser_reads(doc):
    got, want = json_bodies.loads(doc.encode()), json.loads(doc)
    assert repr(got) == repr(want)  # NaN != NaN: compared as written


def test_the_pool_starts_every_thread_before_requests():
    async def go():
        loop = asyncio.get_running_loop()
        executor = off_loop.install_pool(loop, threads=3)
        try:
            started = {t.ident for t in threading.enumerate() if t.name.startswith("mstar-off-loop")}
            ran = set(await asyncio.gather(*(asyncio.to_thread(lambda: time.sleep(0.05) or threading.get_ident())
                                             for _ in range(6))))
            return started, ran, len(executor._threads)
        finally:
            executor.shutdown(wait=True)

    interval = sys.getswitchinterval()
    try:
        started, ran, count = asyncio.run(go())
        assert sys.getswitchinterval() <= off_loop.SWITCH_INTERVAL_S  # the loop gets the GIL back sooner
    finally:
        sys.setswitchinterval(interval)
    assert len(started) == 3 and count == 3
    assert ran <= started  # the work ran in those threads; none was started on demand


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")
def test_the_pools_threads_run_below_the_loop(monkeypatch):
    """The pool's threads take `MSTAR_API_THREAD_NICENESS` steps of nice (default 5) over the loop's thread, which
    keeps its own; a bad value is an error naming the variable."""

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def go():
        loop = asyncio.get_running_loop()
        executor = off_loop.install_pool(loop, threads=2)
        try:
            return niceness(), set(await asyncio.gather(*(asyncio.to_thread(niceness) for _ in range(4))))
        finally:
            executor.shutdown(wait=True)

    interval = sys.getswitchinterval()
    try:
        loop_nice, pool_nice = asyncio.run(go())
        assert pool_nice == {loop_nice + off_loop.POOL_NICENESS} or loop_nice + off_loop.POOL_NICENESS > 19
        monkeypatch.setenv(off_loop.POOL_NICENESS_ENV, "0")
        loop_nice, pool_nice = asyncio.run(go())
        assert pool_nice == {loop_nice}
    finally:
        sys.setswitchinterval(interval)
    for bad in ("-3", "high", "20"):
        monkeypatch.setenv(off_loop.POOL_NICENESS_ENV, bad)
        with pytest.raises(ConfigError, match=off_loop.POOL_NICENESS_ENV):
            off_loop.pool_niceness()


def _app(seen: list[str], loop_thread: list[str]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    router = json_bodies.json_router()

    @router.post("/echo")
    async def echo(body: dict):
        loop_thread.append(threading.current_thread().name)
        return {"keys": sorted(body), "size": len(body.get("text", ""))}

    app.include_router(router)
    return app


class _Buffering:
    """What the server's guard middleware does: the whole body read first, left in the scope and replayed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            chunks, more = [], True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            scope[json_bodies.BODY_KEY] = body = b"".join(chunks)
            sent = []

            async def receive():  # the replay
                if not sent:
                    sent.append(1)
                    return {"type": "http.request", "body": body, "more_body": False}
                return {"type": "http.disconnect"}
        await self.app(scope, receive, send)


@pytest.fixture(params=["buffered", "streamed"])
def client(monkeypatch, request):
    seen: list[str] = []  # the thread of each parse by `json_bodies.loads`
    loop_thread: list[str] = []
    real = json_bodies.loads
    monkeypatch.setattr(json_bodies, "loads", lambda body: seen.append(threading.current_thread().name) or real(body))
    app = _app(seen, loop_thread)
    with TestClient(_Buffering(app) if request.param == "buffered" else app) as c:
        yield c, seen, loop_thread


def test_a_large_body_is_parsed_in_the_pool_and_a_small_one_inline(client):
    c, seen, loop_thread = client
    big = {"text": "word " * (json_bodies.POOL_BYTES // 4), "n": 1}
    r = c.post("/echo", json=big)
    assert r.status_code == 200 and r.json() == {"keys": ["n", "text"], "size": len(big["text"])}
    assert len(seen) == 1 and seen[0] != loop_thread[0], (seen, loop_thread)
    r = c.post("/echo", json={"text": "hi"})
    assert r.status_code == 200 and r.json() == {"keys": ["text"], "size": 2}
    assert seen[1:] == [loop_thread[0]]  # orjson on the loop: no thread hop, and FastAPI does not parse it again


def test_a_large_body_that_is_not_json_gets_the_400_a_small_one_gets(client):
    c, seen, _ = client
    filler = "x" * json_bodies.POOL_BYTES
    answers = []
    for text in (filler, "x"):
        body = '{"text": "' + text + '", }'
        r = c.post("/echo", content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        answers.append((r.json()["error"], body.index("}")))
    (big, big_at), (small, small_at) = answers
    assert big["message"] == small["message"] and "not valid JSON" in big["message"]
    assert big["param"] == str(big_at) and small["param"] == str(small_at)
    assert len(seen) == 2  # each parsed once: the large one in the pool, the small one inline


def test_the_loop_watch_names_what_held_the_loop(caplog):
    def holds_the_loop():
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # Python code: the watch samples it between bytecodes
            sum(range(1000))

    async def go():
        watch = LoopWatch(asyncio.get_running_loop(), 0.05)
        watch.start()
        await asyncio.sleep(0.05)
        holds_the_loop()
        await asyncio.sleep(0.1)
        watch.stop()
        return watch.stalls

    with caplog.at_level(logging.WARNING, logger="mstar.api.loop"):
        stalls = asyncio.run(go())
    assert stalls and max(s for s, _ in stalls) >= 0.2, stalls
    assert any("holds_the_loop" in where for _, where in stalls), stalls
    assert "event loop held" in caplog.text and "loop thread CPU" in caplog.text


def test_a_large_realtime_append_is_decoded_in_the_pool(monkeypatch):
    """Minutes of audio in one append are megabytes of base64: decoded in a pool thread (in pieces), small appends
    where they arrive; the samples are the same either way."""
    from mstar_core.api.realtime import session as session_module
    from mstar_core.api.realtime.limits import RealtimeLimits

    class Bridge:
        model, speaks, voices, default_modalities, takes_audio, takes_visual = "m", False, (), ("text",), True, False

    threads = []
    real = session_module.decode_pcm16
    monkeypatch.setattr(session_module, "decode_pcm16",
                        lambda *a: threads.append(threading.get_ident()) or real(*a))
    pcm = (np.sin(np.arange(30 * 24_000) / 24_000 * 2 * np.pi * 220) * 8000).astype("<i2")
    audio = base64.b64encode(pcm.tobytes()).decode()
    assert len(audio) >= off_loop.LARGE_BYTES

    async def go():
        limits = RealtimeLimits(max_event_bytes=4 << 20, max_buffer_seconds=60)
        session = session_module.RealtimeSession(None, Bridge(), limits, lambda payload: asyncio.sleep(0))
        session.vad = None  # the detector is another test's business
        await session.on_append({"audio": audio})
        await session.on_append({"audio": audio[:4000]})
        return session.buffer, threading.get_ident()

    buffer, loop_thread = asyncio.run(go())
    assert threads[0] != loop_thread and threads[1] == loop_thread
    assert np.array_equal(buffer, np.concatenate([pcm, pcm[:1500]]))


def test_arenas_are_shared_unless_the_operator_set_malloc(monkeypatch):
    import platform

    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert off_loop.share_arenas() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("MSTAR_MALLOC_TUNING", "0")
    assert off_loop.share_arenas() is False
    monkeypatch.delenv("MSTAR_MALLOC_TUNING")
    if platform.libc_ver()[0] == "glibc":
        assert off_loop.share_arenas() is True
    off_loop.release_freed_memory()  # harmless anywhere


@pytest.mark.parametrize("value", [
    {"type": "function", "function": {"name": "f", "description": 'a "quoted" line\nnext\t\u00e9\u4e2d\ud800 \\ ' * 9,
                                      "parameters": {"type": "object", "properties": {"x": {
                                          "type": "integer", "minimum": 1.5, "enum": [1, None, True, "s", -0.0]}}}}},
    [], {}, "x" * 40, 3, None, [float("nan"), float("inf"), 10**30]])
def test_json_text_in_pieces_is_json_dumps(monkeypatch, value):
    monkeypatch.setattr(pieces, "JSON_PIECE", 7)  # every long string cut into many pieces
    assert pieces.json_text(value) == json.dumps(value, ensure_ascii=False)


def test_a_route_without_a_body_parameter_ignores_what_is_posted():
    app = FastAPI()
    install_error_handlers(app)
    router = json_bodies.json_router()

    @router.post("/cancel")
    async def cancel():
        return {"ok": True}

    app.include_router(router)
    with TestClient(app) as c:
        r = c.post("/cancel", content=b"not json", headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json() == {"ok": True}
