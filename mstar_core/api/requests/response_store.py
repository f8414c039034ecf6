"""Stored responses of `/v1/responses`: bounded in count, each kept for a time limit, for `previous_response_id`."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import attrs

#: Responses kept (oldest dropped first) and seconds each is kept (MSTAR_RESPONSES_MAX, MSTAR_RESPONSES_TTL_S).
MAX_STORED = 1024
TTL_S = 3600.0


@attrs.define
class Stored:
    """A response as returned, the conversation it ends (chat messages, for a continuation), and when it expires."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    expires: float


class ResponseStore:
    """An LRU of stored responses by id, each dropped once its time is up."""

    def __init__(self, max_items: int | None = None, ttl_s: float | None = None):
        self.max_items = max_items or int(os.environ.get("MSTAR_RESPONSES_MAX", MAX_STORED))
        self.ttl_s = ttl_s or float(os.environ.get("MSTAR_RESPONSES_TTL_S", TTL_S))
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._items[response["id"]] = Stored(response, messages, time.monotonic() + self.ttl_s)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        self._expire()
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, item in self._items.items() if item.expires <= now]:
            del self._items[rid]


def store_of(app_state: Any) -> ResponseStore:
    """The app's store, made on first use."""
    store = getattr(app_state, "mstar_responses", None)
    if store is None:
        store = app_state.mstar_responses = ResponseStore()
    return store
