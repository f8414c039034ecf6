"""The file store of the Batch API: per owner, each file's bytes and its metadata (OpenAI's file object) on disk."""

from __future__ import annotations

import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

#: OpenAI's file ids; anything else names no file here (and never a path outside the store).
FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one step (a crash leaves the old file or the new one, never half of one)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    """Files by owner: `<root>/<owner>/<id>.json` (the file object, plus private `_` keys) and `<id>.data`."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _dir(self, owner: str) -> Path:
        return self.root / owner

    def create(self, owner: str, filename: str, purpose: str, data: bytes, **private: Any) -> dict[str, Any]:
        """Store `data`; returns the file object (private keys, e.g. `_lines`, are kept for the server only)."""
        directory = self._dir(owner)
        directory.mkdir(parents=True, exist_ok=True)
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        write_atomic(directory / f"{file_id}.data", data)
        meta = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                "status_details": None, **{f"_{k}": v for k, v in private.items()}}
        write_atomic(directory / f"{file_id}.json", orjson.dumps(meta))  # last: a file is listed once whole
        return meta

    def get(self, owner: str, file_id: str) -> dict[str, Any] | None:
        if not FILE_ID.match(file_id):
            return None
        try:
            return orjson.loads((self._dir(owner) / f"{file_id}.json").read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None

    def data_path(self, owner: str, file_id: str) -> Path:
        return self._dir(owner) / f"{file_id}.data"

    def list(self, owner: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """The owner's files, newest first."""
        out = []
        directory = self._dir(owner)
        if directory.is_dir():
            for path in directory.glob("file-*.json"):
                meta = self.get(owner, path.stem)
                if meta is not None and (purpose is None or meta["purpose"] == purpose):
                    out.append(meta)
        return sorted(out, key=lambda m: (m["created_at"], m["id"]), reverse=True)

    def delete(self, owner: str, file_id: str) -> bool:
        if self.get(owner, file_id) is None:
            return False
        (self._dir(owner) / f"{file_id}.json").unlink(missing_ok=True)  # first: a half-deleted file is not listed
        self.data_path(owner, file_id).unlink(missing_ok=True)
        return True


def public(meta: dict[str, Any]) -> dict[str, Any]:
    """A stored object as the API shows it (without the server's private `_` keys)."""
    return {k: v for k, v in meta.items() if not k.startswith("_")}
