"""What the server builds once for the Batch API and its routes read: the stores, the runner and the limits."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import attrs
from fastapi import Request

from mstar_core.api.batch.dispatch import InProcessDispatch
from mstar_core.api.batch.files import FileStore
from mstar_core.api.batch.jobs import BatchStore
from mstar_core.api.batch.runner import BatchRunner
from mstar_core.api.http.errors import ApiError
from mstar_core.runtime.engine import BACKGROUND_PRIORITY

#: Defaults of the server options `batch_max_file_bytes` (OpenAI takes 200 MB), `batch_max_lines` (OpenAI's
#: limit) and `batch_concurrency`.
MAX_FILE_BYTES, MAX_LINES, CONCURRENCY = 64 * 1024 * 1024, 50_000, 4


@attrs.frozen
class BatchLimits:
    """Bounds of the Batch API (server options `batch_*`)."""

    #: the largest input file taken, in bytes
    max_file_bytes: int = MAX_FILE_BYTES
    #: the most requests in one input file
    max_lines: int = MAX_LINES
    #: batch lines in flight at once over every job (each a background request beside live traffic)
    concurrency: int = CONCURRENCY


class BatchService:
    """The file store and job store under `directory` (`files/` and `batches/`), and the runner over `app`."""

    def __init__(self, directory: str | Path, app: Any, api_key: str | None, limits: BatchLimits):
        self.directory = Path(directory)
        self.limits = limits
        self.files = FileStore(self.directory / "files")
        self.jobs = BatchStore(self.directory / "batches")
        self.runner = BatchRunner(self.files, self.jobs, InProcessDispatch(app, api_key, BACKGROUND_PRIORITY),
                                  limits.concurrency)


def batch_service(request: Request) -> BatchService:
    service = getattr(request.app.state, "batch", None)
    if service is None:
        raise ApiError(503, "the Batch API is not set up on this server", type_="server_loading")
    return service


def owner_of(request: Request) -> str:
    """Who a file or batch belongs to: a digest of the bearer token the request was sent with ("anonymous" when
    none). A client sees only what was created with its own key."""
    for name, value in request.scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]
    return "anonymous"
