"""Write a Hugging Face Hub cache by hand, in huggingface_hub's own layout, for tests that run with HF_HUB_OFFLINE=1.

    <cache>/models--ORG--NAME/refs/<branch>             the commit a branch points at
    <cache>/models--ORG--NAME/snapshots/<commit>/...    the files of that commit
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def cache_repo(cache: Path, repo: str, files_from: Path, *, branch: str = "main", commit: str | None = None) -> Path:
    """Put the files of `files_from` into `cache` as the snapshot of `repo` at `branch`; the snapshot directory."""
    commit = commit or hashlib.sha1(f"{repo}@{branch}".encode()).hexdigest()
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    shutil.copytree(files_from, snapshot, dirs_exist_ok=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / branch).write_text(commit)
    return snapshot
