"""Response classes: orjson-rendered JSON, and a byte stream that a failure cuts off detectably."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from mstar_core.errors import RequestError

log = logging.getLogger("mstar.api")


class OrjsonResponse(JSONResponse):
    """JSONResponse rendered by orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


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
