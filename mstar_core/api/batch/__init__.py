"""OpenAI's Batch API underneath its routes (`routes/files.py`, `routes/batches.py`): uploaded JSONL files, batch
jobs kept on disk, and the runner that sends each line through the app's own routes, in this process, at background
priority beside live traffic.

    lines      an input file's lines checked (custom_id, method, url, body), each error naming its line and field
    files      the file store: one directory per owner (the API key that uploaded), content and metadata
    jobs       batch records and their results so far, on disk, so a restarted server resumes them
    dispatch   one line through the app in-process (the same middleware, routes and pipeline as a live request)
    runner     runs jobs: bounded concurrency, retries a busy server, finalizes output and error files
    service    what the server builds once and the routes read: the stores, the runner, the limits
"""

from mstar_core.api.batch.service import BatchLimits, BatchService, batch_service, owner_of

__all__ = ["BatchLimits", "BatchService", "batch_service", "owner_of"]
