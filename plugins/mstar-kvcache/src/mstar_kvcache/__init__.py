"""The `kvcache` engine: paged KV pool, continuous batching, chunked prefill, prefix caching, sampling."""

from __future__ import annotations

from typing import Any

from mstar_core.plugins import hookimpl
from mstar_kvcache.batch import PagedBatch
from mstar_kvcache.engine import KVCacheEngine
from mstar_kvcache.pool import PagePool
from mstar_kvcache.snapshot import CacheSnapshot
from mstar_kvcache.walks import ar_walks

__all__ = ["CacheSnapshot", "KVCacheEngine", "PagePool", "PagedBatch", "ar_walks"]


@hookimpl
def mstar_register_engines(register: Any) -> None:
    """Register the `kvcache` engine kind."""
    register("kvcache", KVCacheEngine)
