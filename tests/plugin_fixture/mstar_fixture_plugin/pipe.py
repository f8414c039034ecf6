"""`fixture_pipe`: a third-party-style transport that is only a point-to-point channel, never a worker link.

It exists so the tests can select, in a placement, a registered transport that cannot carry a
worker's tensors (it does not override `Transport.worker_link`) and see the load refused, naming
the transports that can. Its channel is an in-process queue: enough to be a real `Transport`.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import Transport

#: address -> the queue a bound end reads (one process only)
_BOUND: dict[str, queue.Queue] = {}


class PipeTransport(Transport):
    """A one-way in-process pipe: `bind` reads, `connect` writes."""

    name = "fixture_pipe"

    def __init__(self) -> None:
        self._in: queue.Queue | None = None
        self._out: queue.Queue | None = None
        self._address: str | None = None

    def bind(self, address: str) -> str:
        self._in = _BOUND.setdefault(address, queue.Queue())
        self._address = address
        return address

    def connect(self, address: str) -> None:
        if address not in _BOUND:
            raise TransportError(f"fixture_pipe: nothing bound at {address}")
        self._out = _BOUND[address]

    def send(self, frames: Sequence[Any]) -> None:
        if self._out is None:
            raise TransportError("fixture_pipe: not connected")
        self._out.put([bytes(memoryview(f)) for f in frames])

    def recv(self, timeout: float | None = None) -> list[Any]:
        if self._in is None:
            raise TransportError("fixture_pipe: not bound")
        try:
            return self._in.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"fixture_pipe: nothing within {timeout}s") from None

    def close(self) -> None:
        if self._address is not None:
            _BOUND.pop(self._address, None)
        self._in = self._out = self._address = None
