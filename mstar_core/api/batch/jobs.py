"""Batch jobs on disk: each job's record (OpenAI's batch object) and the results of its lines so far.

`<root>/<owner>/<batch id>.json` is the record, rewritten whole (atomically) on every change of state;
`<batch id>.results.jsonl` gets one line per finished request as it finishes (appended and flushed), so a
server that stops mid-job resumes it with the lines that have no result yet. A line cut short by a crash is
ignored when read (its request runs again).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from mstar_core.api.batch.files import write_atomic

log = logging.getLogger("mstar.batch")

BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")
#: States a job leaves by itself; a server that restarts picks these up again.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
#: Completion windows taken (OpenAI's only one), in seconds.
COMPLETION_WINDOWS = {"24h": 24 * 3600}


class BatchStore:
    """Every job by id, in memory and on disk (loaded at startup)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._jobs: dict[str, dict[str, Any]] = {}
        self._load()

    def _load(self) -> None:
        if not self.root.is_dir():
            return
        for path in self.root.glob("*/batch_*.json"):
            try:
                record = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError) as exc:
                log.warning("skipping unreadable batch record %s: %s", path, exc)
                continue
            if BATCH_ID.match(record.get("id", "")) and record.get("_owner") == path.parent.name:
                self._jobs[record["id"]] = record

    def create(self, owner: str, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None, total: int) -> dict[str, Any]:
        now = int(time.time())
        record = {
            "id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + COMPLETION_WINDOWS[completion_window], "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata,
            "_owner": owner,
        }
        self._jobs[record["id"]] = record
        self.save(record)
        return record

    def get(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        record = self._jobs.get(batch_id)
        return record if record is not None and record["_owner"] == owner else None

    def list(self, owner: str) -> list[dict[str, Any]]:
        """The owner's jobs, newest first."""
        mine = [r for r in self._jobs.values() if r["_owner"] == owner]
        return sorted(mine, key=lambda r: (r["created_at"], r["id"]), reverse=True)

    def unfinished(self) -> list[dict[str, Any]]:
        return sorted((r for r in self._jobs.values() if r["status"] in UNFINISHED), key=lambda r: r["created_at"])

    def _dir(self, record: dict[str, Any]) -> Path:
        directory = self.root / record["_owner"]
        directory.mkdir(parents=True, exist_ok=True)
        return directory

    def save(self, record: dict[str, Any]) -> None:
        write_atomic(self._dir(record) / f"{record['id']}.json", orjson.dumps(record))

    def set_status(self, record: dict[str, Any], status: str) -> None:
        """Move the job to `status`, stamping `<status>_at` where the batch object has one, and save it."""
        record["status"] = status
        stamp = f"{status}_at"
        if stamp in record and record[stamp] is None:
            record[stamp] = int(time.time())
        self.save(record)

    def results_path(self, record: dict[str, Any]) -> Path:
        return self._dir(record) / f"{record['id']}.results.jsonl"

    def append_result(self, record: dict[str, Any], result: dict[str, Any]) -> None:
        with open(self.results_path(record), "ab") as f:
            f.write(orjson.dumps(result) + b"\n")
            f.flush()

    def read_results(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The results kept so far (a last line a crash cut short is dropped: that request runs again)."""
        path = self.results_path(record)
        if not path.exists():
            return []
        out = []
        for row in path.read_bytes().split(b"\n"):
            if not row.strip():
                continue
            try:
                out.append(orjson.loads(row))
            except orjson.JSONDecodeError:
                continue
        return out

    def drop_results(self, record: dict[str, Any]) -> None:
        self.results_path(record).unlink(missing_ok=True)
