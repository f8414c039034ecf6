"""Response classes: orjson-rendered JSON, and a byte stream that a failure cuts off detectably."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from mstar_core.errors import RequestError

log = logging.getLogger("mstar.api")


def json_bytes(obj: Any) -> bytes:
    """JSON bytes via orjson (numpy included); text it cannot write as UTF-8 is replaced rather than fatal.

    A JSON body may carry a lone surrogate ("\\ud800"), which Python's parser accepts; when such text comes
    back in an output or an error message, orjson refuses it, and that must not turn an answer into a 500.
    """
    option = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    try:
        return orjson.dumps(obj, option=option)
    except orjson.JSONEncodeError as exc:
        if "surrogates" not in str(exc):
            raise
        return orjson.dumps(_valid_utf8(obj), option=option)


def _valid_utf8(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_valid_utf8(k): _valid_utf8(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_valid_utf8(v) for v in value]
    return value


class OrjsonResponse(JSONResponse):
    """JSONResponse rendered by orjson."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


class CutOnErrorStreamingResponse(StreamingResponse):
    """A raw byte stream (pcm, wav) that, when its body fails after the status line went out, ends without the
    final chunk.

    Raw audio has no room for an error event, so the failure must show in the framing: the chunked body never
    gets its terminating chunk and the server closes the connection, which every HTTP client reports as an
    incomplete body (httpx: RemoteProtocolError), never as a clean end of audio. The failure is logged in one
    line (a traceback only when the cause is a bug rather than a failed request).
    """

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunks = aiter(self.body_iterator)
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except Exception as exc:  # any failure of the body ends the stream the same way
                _log_cut(exc)
                return  # without more_body=False: the server closes the connection mid-body
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _log_cut(exc: BaseException) -> None:
    if isinstance(exc, RequestError):
        log.warning("stream cut mid-body (the client sees an incomplete response): %s: %s", type(exc).__name__, exc)
    else:
        log.error("stream cut mid-body by an internal error (the client sees an incomplete response)", exc_info=exc)
