"""Stored responses of `/v1/responses`: bounded in count and in bytes (each entry measured as its JSON), each kept
for a time limit, for `previous_response_id`."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import attrs

from mstar_core.api.http.bodies import json_bytes

#: Responses kept (oldest dropped first), their bytes all together, and seconds each is kept (MSTAR_RESPONSES_MAX,
#: MSTAR_RESPONSES_MAX_BYTES, MSTAR_RESPONSES_TTL_S). One response larger than the byte bound is not kept.
MAX_STORED = 1024
MAX_STORED_BYTES = 256 * 1024 * 1024
TTL_S = 3600.0


@attrs.define
class Stored:
    """A response as returned, the conversation it ends (chat messages, for a continuation), and when it expires."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    expires: float
    size: int = 0  # bytes of its JSON (response and conversation)


class ResponseStore:
    """An LRU of stored responses by id, each dropped once its time is up."""

    def __init__(self, max_items: int | None = None, ttl_s: float | None = None, max_bytes: int | None = None):
        self.max_items = max_items or int(os.environ.get("MSTAR_RESPONSES_MAX", MAX_STORED))
        self.max_bytes = max_bytes or int(os.environ.get("MSTAR_RESPONSES_MAX_BYTES", MAX_STORED_BYTES))
        self.ttl_s = ttl_s or float(os.environ.get("MSTAR_RESPONSES_TTL_S", TTL_S))
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep a response (dropping the oldest past the bounds); False if it alone is past the byte bound."""
        self._expire()
        size = len(json_bytes(response)) + len(json_bytes(messages))
        if size > self.max_bytes:
            return False
        self._drop(response["id"])
        self._items[response["id"]] = Stored(response, messages, time.monotonic() + self.ttl_s, size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        return True

    def _drop(self, rid: str) -> bool:
        item = self._items.pop(rid, None)
        if item is None:
            return False
        self.bytes -= item.size
        return True

    def get(self, rid: str) -> Stored | None:
        self._expire()
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._drop(rid)

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, item in self._items.items() if item.expires <= now]:
            self._drop(rid)


def store_of(app_state: Any) -> ResponseStore:
    """The app's store, made on first use."""
    store = getattr(app_state, "mstar_responses", None)
    if store is None:
        store = app_state.mstar_responses = ResponseStore()
    return store
