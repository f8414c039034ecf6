"""What every route shares: model/adapter lookup, submission with error mapping, disconnect handling, SSE."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import Request

from mstar_core.api.http.bodies import json_bytes
from mstar_core.api.http.errors import ApiError, error_body, from_request_error, retry_after
from mstar_core.errors import MStarError, RequestCancelled, RequestError

log = logging.getLogger("mstar.api")
T = TypeVar("T")


def sse(payload: Any) -> bytes:
    """One server-sent event carrying JSON (or a literal string such as [DONE])."""
    data = payload.encode() if isinstance(payload, str) else json_bytes(payload)
    return b"data: " + data + b"\n\n"


def adapter_call(fn: Callable[..., Any], *args: Any, what: str, **kw: Any) -> Any:
    """Run an adapter hook; bad-input exceptions become 400s naming the hook, RequestError keeps its status."""
    try:
        return fn(*args, **kw)
    except RequestError as exc:
        raise from_request_error(exc) from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
        raise ApiError(400, f"{what} rejected the request: {type(exc).__name__}: {exc}") from None


#: The key of a request's ASGI `scope["state"]` (`request.state`) that carries its priority class. Only an in-process
#: caller can set it (the Batch API's runner sets `runtime.engine.BACKGROUND_PRIORITY`); no header reaches it.
PRIORITY_STATE = "mstar_priority"


def request_priority(request: Request) -> float:
    """The priority class the request was dispatched with: 0 (live) unless an in-process caller set one."""
    return float(getattr(request.state, PRIORITY_STATE, 0.0) or 0.0)


async def submit(state: Any, model: str, inputs: Mapping[str, Any], *, priority: float = 0.0) -> Any:
    """`AsyncEngine.submit` with its errors mapped: RequestError keeps its status (503 gets Retry-After).

    The request takes its admission place first, before any await (so a burst of any size admits
    exactly the free places), and gives it back on every path that does not start it. It is
    prepared off the event loop (`AsyncEngine.prepare`: tokenizing, decoding and resizing uploads),
    so one large upload does not stall every other request's stream.
    """
    if state.draining:
        raise ApiError(503, "the server is shutting down; retry against another instance",
                       headers=retry_after(5), type_="server_shutting_down")
    try:
        place = state.engine.admission.take()
    except RequestError as exc:
        raise from_request_error(exc) from None
    try:
        # prepare here (not in submit) so routes keep the prepared inputs, e.g. prompt ids for `usage`
        try:
            prepared = await state.engine.prepare(model, inputs)
        except BaseException:
            place.release()
            raise
        # the engine owns the place from here: it gives it back when the request ends, or now if it cannot start
        handle = state.engine.submit(model, prepared, timeout=state.config.request_timeout, prepared=True,
                                     place=place, **({"priority": priority} if priority else {}))
    except RequestError as exc:
        raise from_request_error(exc) from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, MStarError) as exc:
        # a model's prepare() or plan choking on an input is still the input's fault
        raise ApiError(400, f"model '{model}' rejected the inputs: {type(exc).__name__}: {exc}") from None
    handle.prepared = prepared
    state.track(handle)
    return handle


async def watch_disconnect(request: Request) -> None:
    """Return when the client goes away (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or a 499 if the client goes away first: `work` is then cancelled, and with it what it was
    waiting for (a grammar compile no other request waits for is stopped, its process killed)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(watch_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ApiError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


async def result_or_disconnect(request: Request, handle: Any) -> dict[str, Any]:
    """The request's final env; if the client disconnects first, cancel it (freeing its pages) and raise."""
    watcher = asyncio.ensure_future(watch_disconnect(request))
    result = asyncio.ensure_future(handle.result())
    try:
        done, _ = await asyncio.wait({watcher, result}, return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return map_result(result)
        handle.cancel()
        raise ApiError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not result.done():
            handle.cancel()
            result.cancel()


def map_result(task: asyncio.Future) -> Any:
    try:
        return task.result()
    except RequestError as exc:
        raise from_request_error(exc) from None


async def first_then_rest(request: Request, handle: Any) -> tuple[Any, AsyncIterator[Any]]:
    """Wait for the first output (errors before it still get a proper status), then iterate the rest.

    Returns (first output or None if the request ended without output, iterator over the rest).
    """
    held, rest = await held_until(request, handle, lambda _out: True)
    return (held[0] if held else None), rest


async def held_until(request: Request, handle: Any, wanted: Callable[[Any], bool]) -> tuple[list[Any], AsyncIterator[Any]]:
    """Read outputs until the first one `wanted` accepts (or the end) before the route commits to a 200.

    A failure before that output (e.g. the codec worker of a speech request lost while the LM already
    produced tokens) still gets its own status (a 503 with Retry-After), not a 200 cut short.
    Returns (the outputs read, the last of them the wanted one unless the request ended; the iterator).
    """
    iterator = handle.__aiter__()
    watcher = asyncio.ensure_future(watch_disconnect(request))
    held: list[Any] = []
    nxt: asyncio.Future | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({watcher, nxt}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                handle.cancel()
                raise ApiError(499, "client disconnected")
            try:
                out = nxt.result()
            except StopAsyncIteration:
                return held, iterator
            except RequestError as exc:
                raise from_request_error(exc) from None
            held.append(out)
            if wanted(out):
                return held, iterator
    finally:
        watcher.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            handle.cancel()


@contextlib.asynccontextmanager
async def cancel_on_exit(handle: Any):
    """Whatever ends a streaming body (done, client gone, server stopping), the request is cancelled."""
    try:
        yield
    finally:
        handle.cancel()


def stream_error_payload(exc: BaseException) -> dict[str, Any]:
    """An error to put inside an already started stream (the status line has gone out)."""
    if isinstance(exc, RequestCancelled):
        return error_body(499, "request cancelled")
    if isinstance(exc, RequestError):
        return error_body(int(getattr(exc, "status", 500)), str(exc), getattr(exc, "param", None), None,
                          getattr(exc, "error_type", None))
    log.exception("error inside a stream", exc_info=exc)
    return error_body(500, f"internal error: {type(exc).__name__}")
