"""Worker links through the plugin registry: the transport a placement names carries a worker's tensors.

The core imports no transport plugin: it looks the name up in the registry (`mstar_register_transports`)
and asks the class for one end of a worker link (`Transport.worker_link`). Control messages always
travel on the ZeroMQ control socket, which the core owns; so `zmq`, the default, needs no plugin to
mean "every frame on that socket" when the zmq plugin is not loaded (`MSTAR_PLUGINS` left it out).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mstar_core.config.placement import Placement
from mstar_core.errors import ConfigError
from mstar_core.wire.curve import needs_encryption
from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import InlineLink, Transport, TransportLink

log = logging.getLogger("mstar.links")

#: The transport of workers whose placement names none.
DEFAULT_TRANSPORT = "zmq"


def carries_worker_links(cls: Any) -> bool:
    """True when a registered transport class can make worker links (overrides `Transport.worker_link`)."""
    method = getattr(cls, "worker_link", None)
    return method is not None and getattr(method, "__func__", None) is not Transport.worker_link.__func__


def link_transport(registry: Any, name: str) -> Any:
    """The registered class of transport `name`, or None for the built-in inline `zmq` link; ConfigError if unusable."""
    if name == DEFAULT_TRANSPORT and name not in registry.transports:
        return None
    if name not in registry.transports:
        known = sorted({*registry.transports, DEFAULT_TRANSPORT})
        raise ConfigError(f"unknown transport '{name}'; known: {', '.join(known)} (install the plugin that "
                          f"registers it, or check MSTAR_PLUGINS)")
    cls = registry.transports.get(name)
    if not carries_worker_links(cls):
        usable = sorted({n for n, c in registry.transports.items() if carries_worker_links(c)} | {DEFAULT_TRANSPORT})
        raise ConfigError(f"transport '{name}' cannot carry a worker's tensors; use one of: {', '.join(usable)}")
    return cls


def check_transports(placement: Placement, registry: Any) -> None:
    """Every worker's transport in `placement` is registered, can carry a worker's tensors, and suits its launcher."""
    remote = placement.bind is not None and needs_encryption(placement.bind)
    for name, spec in placement.workers.items():
        where = f"{placement.source}: workers.{name}.transport"
        try:
            cls = link_transport(registry, spec.transport)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        options = dict(spec.transport_options)
        if cls is None and options:
            raise ConfigError(f"{where}: transport '{spec.transport}' takes no options")
        if cls is not None:
            try:
                cls.check_link_options(options, remote=remote)
            except TransportError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        if getattr(cls, "same_host", False) and spec.launcher != "spawn":
            raise ConfigError(f"{where}: {spec.transport} needs a worker spawned on this host (launcher: spawn), "
                              f"not launcher: {spec.launcher}")


def open_link(registry: Any, name: str, role: str, options: Mapping[str, Any] | None = None) -> TransportLink:
    """One end (`role` 'server' or 'worker') of a worker link over transport `name` (with placement's options)."""
    cls = link_transport(registry, name)
    if cls is None:
        return InlineLink(DEFAULT_TRANSPORT)
    return cls.worker_link(role, **options) if options else cls.worker_link(role)


class OrderedInbox:
    """Delivers one link's messages in arrival order without blocking the event loop on frames still arriving.

    `put` takes what `TransportLink.unpack` returned: frames are delivered at once when nothing of
    this link waits before them; a future (frames a process group is still receiving) and whatever
    comes after it wait in line, drained by a task, so other links' messages go on meanwhile.
    A future that fails drops its message (`on_error` says why); the next ones are still delivered.
    """

    def __init__(self, deliver: Callable[[list[Any]], None], on_error: Callable[[BaseException], None]):
        self._deliver = deliver
        self._on_error = on_error
        self._queue: collections.deque[Any] = collections.deque()
        self._task: asyncio.Task | None = None

    def put(self, item: list[Any] | concurrent.futures.Future) -> None:
        if not self._queue and not isinstance(item, concurrent.futures.Future):
            self._deliver(item)
            return
        self._queue.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        while self._queue:
            item = self._queue[0]
            if isinstance(item, concurrent.futures.Future):
                try:
                    item = await asyncio.wrap_future(item)
                except asyncio.CancelledError:
                    if not item.cancelled():
                        raise  # the drain itself was cancelled (clear)
                    item = None
                except Exception as exc:
                    self._on_error(exc)
                    item = None
            self._queue.popleft()
            if item is not None:
                try:
                    self._deliver(item)
                except Exception:  # one message's handling must not stop the link's delivery
                    log.exception("delivering a message from a worker link failed")

    def clear(self) -> None:
        """Drop everything waiting (the peer is gone)."""
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
            self._task = None
