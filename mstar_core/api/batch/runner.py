"""Runs batch jobs in the serving process, beside live traffic.

Each job's lines go through `dispatch` (the app's own routes, at background priority), at most `concurrency`
lines at once over all jobs: the schedulers serve live calls first, and this bound keeps a large job from
filling the engine's admission places or its batch. A line answered 429 or 503 (the server busy or draining)
waits and tries again, so a batch soaks up spare capacity instead of failing under load; any other answer is
its result. Results are kept as they come (`jobs.BatchStore.append_result`); a restarted server runs only the
lines without one. At the end the results become the output file (2xx answers) and the error file (the rest),
in the order of the input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson

from mstar_core.api.batch.files import FileStore
from mstar_core.api.batch.jobs import BatchStore

log = logging.getLogger("mstar.batch")

Dispatch = Callable[[str, bytes, asyncio.Event], Awaitable[tuple[int, bytes]]]
#: Answers that mean "not now": the line waits and tries again (first after RETRY_FIRST s, doubling to RETRY_MAX).
RETRY_STATUSES = (429, 503)
RETRY_FIRST, RETRY_MAX = 0.5, 15.0


class BatchRunner:
    """Starts, resumes and cancels jobs; one asyncio task per running job."""

    def __init__(self, files: FileStore, jobs: BatchStore, dispatch: Dispatch, concurrency: int):
        self.files = files
        self.jobs = jobs
        self.dispatch = dispatch
        self.concurrency = concurrency
        self._slots: asyncio.Semaphore | None = None  # lines in flight over every job
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: dict[str, asyncio.Event] = {}

    def resume(self) -> None:
        """Start every job a previous run of the server left unfinished."""
        for record in self.jobs.unfinished():
            log.info("resuming batch %s (%s)", record["id"], record["status"])
            self.start(record)

    def start(self, record: dict[str, Any]) -> None:
        if record["id"] not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._run(record), name=f"mstar-batch-{record['id']}")
            self._tasks[record["id"]] = task
            task.add_done_callback(lambda _t, bid=record["id"]: self._tasks.pop(bid, None))

    def cancel(self, record: dict[str, Any]) -> None:
        """Stop the job's lines (those running see their client leave); what finished is kept in its files."""
        if record["status"] not in ("validating", "in_progress"):
            return
        self.jobs.set_status(record, "cancelling")
        self._event(record).set()
        self.start(record)  # (a job not running yet finalizes as cancelled)

    async def close(self) -> None:
        """Stop every job where it stands (the server is stopping): each resumes when the server starts again."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def _event(self, record: dict[str, Any]) -> asyncio.Event:
        return self._cancelled.setdefault(record["id"], asyncio.Event())

    async def _run(self, record: dict[str, Any]) -> None:
        try:
            if record["status"] == "validating":
                self.jobs.set_status(record, "in_progress")
            if record["status"] == "in_progress":
                await self._run_lines(record)
            self._finalize(record)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the job's own failure (its files unreadable, the disk full): the job fails
            log.exception("batch %s failed", record["id"])
            record["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message":
                                                            f"{type(exc).__name__}: {exc}", "param": None,
                                                            "line": None}]}
            self.jobs.set_status(record, "failed")
        finally:
            self._cancelled.pop(record["id"], None)

    def _lines(self, record: dict[str, Any], done: set[str]) -> Iterator[tuple[int, dict[str, Any]]]:
        path = self.files.data_path(record["_owner"], record["input_file_id"])
        with open(path, "rb") as f:
            for number, row in enumerate(f, 1):
                if row.strip():
                    item = orjson.loads(row)
                    if item["custom_id"] not in done:
                        yield number, item

    async def _run_lines(self, record: dict[str, Any]) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        kept = self.jobs.read_results(record)
        counts = record["request_counts"]
        counts["completed"] = sum(1 for r in kept if r["error"] is None)
        counts["failed"] = len(kept) - counts["completed"]
        todo = self._lines(record, {r["custom_id"] for r in kept})
        cancelled = self._event(record)

        async def worker() -> None:
            for number, item in todo:  # one iterator shared by the workers: each line is taken once
                if cancelled.is_set() or time.time() >= record["expires_at"]:
                    return
                async with self._slots:
                    result = await self._one(record, item, cancelled)
                if result is None:  # cancelled while it ran: it counts as not run
                    return
                result["_line"] = number
                self.jobs.append_result(record, result)  # (the results file is what a restart counts from)
                counts["completed" if result["error"] is None else "failed"] += 1

        workers = [asyncio.ensure_future(worker()) for _ in range(self.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
        self.jobs.save(record)

    async def _one(self, record: dict[str, Any], item: dict[str, Any], cancelled: asyncio.Event
                   ) -> dict[str, Any] | None:
        """One line's result (OpenAI's output line), or None when the job was cancelled before it ended."""
        body = orjson.dumps(item["body"])
        delay = RETRY_FIRST
        while True:
            status, raw = await self.dispatch(item["url"], body, cancelled)
            if cancelled.is_set():
                return None
            if status not in RETRY_STATUSES or time.time() + delay >= record["expires_at"]:
                break
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX)
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = {"error": {"message": raw.decode("utf-8", "replace")[:1000], "type": "server_error"}}
        error = None
        if not 200 <= status < 300:
            detail = answer.get("error") if isinstance(answer, dict) else None
            detail = detail if isinstance(detail, dict) else {}
            error = {"code": detail.get("code") or detail.get("type") or f"http_{status}",
                     "message": detail.get("message") or f"the request was answered {status}"}
        return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": item["custom_id"],
                "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex[:24]}", "body": answer},
                "error": error}

    def _finalize(self, record: dict[str, Any]) -> None:
        """Write the output and error files from the results kept and end the job (completed, cancelled, expired)."""
        if record["status"] == "in_progress":
            self.jobs.set_status(record, "finalizing")
        results = sorted(self.jobs.read_results(record), key=lambda r: r.pop("_line", 0))
        ok = [r for r in results if r["error"] is None]
        bad = [r for r in results if r["error"] is not None]
        owner = record["_owner"]
        for rows, key, suffix in ((ok, "output_file_id", "output"), (bad, "error_file_id", "error")):
            if rows and record[key] is None:
                data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
                record[key] = self.files.create(owner, f"{record['id']}_{suffix}.jsonl", "batch_output", data)["id"]
        record["request_counts"].update(completed=len(ok), failed=len(bad))
        if record["status"] == "cancelling":
            final = "cancelled"
        elif len(results) < record["request_counts"]["total"] and time.time() >= record["expires_at"]:
            final = "expired"
        else:
            final = "completed"
        self.jobs.set_status(record, final)
        self.jobs.drop_results(record)
