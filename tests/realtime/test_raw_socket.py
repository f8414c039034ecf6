"""A raw WebSocket client at /v1/realtime: the handshake's guards, malformed and oversized frames (each an
`error` event naming the problem, the session going on), admission, and a dropped connection freeing its work."""

from __future__ import annotations

import asyncio
import base64
import json
import socket

import pytest

from tests.realtime.helpers import pages_used
from tests.server.helpers import API_KEY

pytest.importorskip("websockets")
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus


def _url(srv, model: str = "toy-chat") -> str:
    return srv.url.replace("http", "ws") + f"/v1/realtime?model={model}"


async def _connect(srv, model: str = "toy-chat", key: str | None = API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ws = await connect(_url(srv, model), additional_headers=headers, max_size=None)
    return ws


async def _next(ws, kind: str | None = None) -> dict:
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if kind is None or ev["type"] == kind:
            return ev


def test_handshake_needs_the_api_key(rt_server):
    async def go():
        with pytest.raises(InvalidStatus) as err:
            await _connect(rt_server, key=None)
        assert err.value.response.status_code == 403
        with pytest.raises(InvalidStatus):
            await _connect(rt_server, key="wrong")

    asyncio.run(go())


def test_unknown_model_gets_an_error_event_and_a_policy_close(rt_server):
    async def go():
        ws = await _connect(rt_server, model="no-such-model")
        ev = await _next(ws)
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        return ev, ws.close_code

    ev, code = asyncio.run(go())
    assert ev["type"] == "error" and ev["error"]["param"] == "model" and "no-such-model" in ev["error"]["message"]
    assert code == 1008


BAD = [
    ("not json at all", None, "invalid_json"),
    (json.dumps([1, 2]), "type", "invalid_event"),
    (json.dumps({"type": "no.such.event", "event_id": "e1"}), "type", "unknown_event"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%not base64%%%"}), "audio", "invalid_base64"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}), "audio",
     "invalid_audio"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}}),
     "session.audio.input.format", "invalid_value"),
    (json.dumps({"type": "session.update", "session": {"bogus": 1}}), "session.bogus", None),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"threshold": 7}}}}}),
     "session.audio.input.turn_detection.threshold", None),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                              "content": [{"type": "input_file"}]}}),
     "item.content[0].type", None),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                              "content": [{"type": "input_image"}]}}),
     "item.content[0].image_url", "invalid_media"),
    (json.dumps({"type": "conversation.item.delete", "item_id": "missing"}), "item_id", "item_not_found"),
    (json.dumps({"type": "response.cancel"}), "response_id", "response_cancel_not_active"),
    (json.dumps({"type": "input_audio_buffer.commit"}), None, "input_audio_buffer_commit_empty"),
    (json.dumps({"type": "response.create", "response": {"max_output_tokens": 0}}), "response.max_output_tokens", None),
]


def test_malformed_events_get_errors_and_the_session_goes_on(rt_server):
    async def go():
        ws = await _connect(rt_server)
        await _next(ws, "session.created")
        got = []
        for frame, _, _ in BAD:
            await ws.send(frame)
            got.append(await _next(ws))
        await ws.send(b"\x00binary")  # a binary frame: events are JSON text
        got.append(await _next(ws))
        # frames over the event limit (256 KiB here) and a buffer past its 3 s bound
        big = base64.b64encode(b"\x00" * 300_000).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": big}))
        got.append(await _next(ws))
        second = base64.b64encode(b"\x01\x00" * 24_000).decode()
        for _ in range(3):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": second}))
        got.append(await _next(ws))
        await ws.send(json.dumps({"type": "session.update", "event_id": "ok", "session": {"instructions": "hi"}}))
        updated = await _next(ws)
        await ws.close()
        return got, updated

    got, updated = asyncio.run(go())
    for ev, (frame, param, code) in zip(got, BAD, strict=False):
        assert ev["type"] == "error", (frame, ev)
        assert ev["error"]["param"] == param, (frame, ev["error"])
        if code is not None:
            assert ev["error"]["code"] == code, (frame, ev["error"])
    assert got[2]["error"]["event_id"] == "e1"  # the error names the client event that caused it
    binary, too_big, full = got[len(BAD):]
    assert binary["error"]["code"] == "invalid_frame"
    assert too_big["error"]["code"] == "event_too_large"
    assert full["error"]["code"] == "input_audio_buffer_full"
    assert updated["type"] == "session.updated" and updated["session"]["instructions"] == "hi"


def test_a_full_server_refuses_with_try_again_later(rt_server):
    async def go():
        held = [await _connect(rt_server) for _ in range(4)]  # the fixture's MSTAR_REALTIME_MAX_SESSIONS
        for ws in held:
            await _next(ws, "session.created")
        extra = await _connect(rt_server)
        ev = await _next(extra)
        with pytest.raises(ConnectionClosed):
            await extra.recv()
        for ws in held:
            await ws.close()
        await asyncio.sleep(0.2)
        again = await _connect(rt_server)  # places come back when sessions close
        created = await _next(again)
        await again.close()
        return ev, extra.close_code, created

    ev, code, created = asyncio.run(go())
    assert ev["type"] == "error" and ev["error"]["code"] == "server_overloaded"
    assert code == 1013
    assert created["type"] == "session.created"


def test_connections_at_once_never_pass_the_session_limit(rt_server):
    """Twelve connections at once against a limit of 4: at most 4 sessions are created (nothing is awaited between
    a connection's count check and its session taking the place; a thread hop there once let all of them in)."""
    async def go():
        conns = await asyncio.gather(*(_connect(rt_server) for _ in range(12)))
        firsts = await asyncio.gather(*(_next(ws) for ws in conns))
        for ws in conns:
            await ws.close()
        return [ev["type"] for ev in firsts], [ev.get("error", {}).get("code") for ev in firsts]

    kinds, codes = asyncio.run(go())
    assert 1 <= kinds.count("session.created") <= 4, kinds
    assert codes.count("server_overloaded") == 12 - kinds.count("session.created"), codes


def test_a_dropped_connection_frees_its_response(rt_server):
    async def go():
        ws = await _connect(rt_server)
        await _next(ws, "session.created")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "y" * 500}]}}))
        await ws.send(json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}}))
        await _next(ws, "response.output_text.delta")
        busy = pages_used(rt_server, "toy-chat", "lm")
        ws.transport.abort()  # no close frame: the network went away
        for _ in range(50):
            await asyncio.sleep(0.1)
            if pages_used(rt_server, "toy-chat", "lm") == 0:
                break
        return busy, pages_used(rt_server, "toy-chat", "lm")

    busy, after = asyncio.run(go())
    assert busy > 0 and after == 0


@pytest.mark.slow
def test_a_client_that_never_reads_is_dropped_and_its_place_freed(rt_server):
    """A client that sends events whose answers it never reads: once a write has waited `send_timeout` (10 s) on
    its full socket the server drops it without waiting for the socket to take a close frame, and its place is
    free again within 30 s (the fixture holds 4 sessions: 3 others plus this one fill it)."""
    import time

    async def go():
        held = [await _connect(rt_server) for _ in range(3)]
        for ws in held:
            await _next(ws, "session.created")
        silent = _silent_socket("127.0.0.1", rt_server.port, "/v1/realtime?model=toy-chat",
                                {"Authorization": f"Bearer {API_KEY}"})
        text = "z" * 200_000  # each item comes back twice (added, done): ~400 KB of events a send
        frame = _text_frame(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
        t0 = time.monotonic()  # from its first event (its sends end when the server stops reading them)
        sending = asyncio.ensure_future(asyncio.to_thread(_send_all, silent, [frame] * 40))
        freed = None
        while time.monotonic() - t0 < 40:
            await asyncio.sleep(1.0)
            probe = await _connect(rt_server)
            ev = await _next(probe)
            await probe.close()
            if ev["type"] == "session.created":
                freed = time.monotonic() - t0
                break
        silent.close()
        await sending
        for ws in held:
            await ws.close()
        return freed

    freed = asyncio.run(go())
    assert freed is not None and freed <= 30, freed


def _silent_socket(host: str, port: int, path: str, headers: dict[str, str]) -> socket.socket:
    """A WebSocket client that never reads: a raw socket after the upgrade request (its answer is left unread too),
    with a small receive buffer, so what the server writes backs up into the server as it does over a network.
    (A client library keeps reading into its own memory, and a loopback socket's buffer grows to 32 MB.)"""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)  # before connecting: no autotuning
    sock.connect((host, port))
    sock.settimeout(30)  # a server that stops reading it (it dropped the session) ends the sending with an error
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
             *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def _send_all(sock: socket.socket, frames: list[bytes]) -> None:
    """Send until done or the server stops taking them (it dropped the session meanwhile)."""
    try:
        for frame in frames:
            sock.sendall(frame)
    except OSError:
        pass


def _text_frame(text: str) -> bytes:
    """A client's text frame, masked with a zero key (legal, and the payload then goes as it is)."""
    data = text.encode()
    n = len(data)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
                             if n < 65536 else bytes([0x80 | 127]) + n.to_bytes(8, "big"))
    return head + b"\0\0\0\0" + data
