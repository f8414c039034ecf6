"""A body over the limit gets a 413 the client can read, even a client that writes its whole body before reading."""

from __future__ import annotations

import json
import socket

from tests.server.helpers import API_KEY


def _post_whole_body_then_read(port: int, size: int, expect: bool = False, headers: str = "") -> bytes:
    head = (f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {size}\r\n"
            + ("Expect: 100-continue\r\n" if expect else "") + headers + "\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        if not expect:
            chunk = b" " * (1 << 20)
            sent = 0
            while sent < size:  # the whole body first, as curl without Expect and most clients do
                n = min(len(chunk), size - sent)
                sock.sendall(chunk[:n])
                sent += n
        reply = b""
        while True:
            data = sock.recv(65536)
            if not data:
                return reply
            reply += data
            if b"\r\n\r\n" in reply and reply.endswith(b"}}"):
                return reply


def _status_and_error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_50_mb_body_gets_a_readable_413(server):
    status, err = _status_and_error(_post_whole_body_then_read(server.port, 50 * 1024 * 1024))
    assert status == 413 and "larger than the server's limit" in err["message"]


def test_a_client_that_asks_to_close_still_reads_its_413(server):
    # with `Connection: close` the server used to answer at once and close with the body unread: a reset
    reply = _post_whole_body_then_read(server.port, 50 * 1024 * 1024, headers="Connection: close\r\n")
    status, err = _status_and_error(reply)
    assert status == 413 and "larger than the server's limit" in err["message"]


def test_expect_100_continue_gets_the_413_without_sending_the_body(server):
    status, _ = _status_and_error(_post_whole_body_then_read(server.port, 50 * 1024 * 1024, expect=True))
    assert status == 413
