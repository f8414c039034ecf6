"""Checkpoints named by Hugging Face Hub id (`ORG/NAME[@REVISION]`), resolved to a snapshot in huggingface_hub's cache.

A checkpoint value is a local path when one exists under that name (a local path always wins), else a Hub id:
downloaded into the cache with a progress bar when online, read from the cache alone when `HF_HUB_OFFLINE=1`. What
fails either way is a `CheckpointError` naming the id and the cache directory, so the user knows where to look.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import attrs

from mstar_core.checkpoint.errors import CheckpointError

#: `ORG/NAME` (the Hub's own rule: letters, digits, `-`, `_`, `.`), optionally `@REVISION` (branch, tag or commit)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?:@(?P<revision>[\w.\-/]{1,128}))?$")

#: What a checkpoint directory is read from; the rest of a repository (ONNX or GGUF exports, `original/`
#: consolidated weights, READMEs with images) is never fetched. `*` also matches `/`: subfolders are included.
METADATA_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
WEIGHT_PATTERNS = ("*.safetensors",)
#: torch weight files: fetched only when a repository has no safetensors (they are read `weights_only`)
TORCH_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth")

_TRUE = {"1", "on", "yes", "true"}


@attrs.frozen
class HubId:
    """A model repository on the Hugging Face Hub, at a revision (None: its default branch)."""

    repo: str
    revision: str | None = None

    @classmethod
    def parse(cls, text: str) -> HubId | None:
        """`ORG/NAME[@REVISION]` as a HubId; None for anything else (an absolute or relative path, a file name)."""
        match = _HUB_ID.match(text.strip())
        if match is None or text.startswith((".", "~")) or ".." in match["repo"]:
            return None
        return cls(match["repo"], match["revision"])

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"


def hub_cache_dir() -> Path:
    """The cache huggingface_hub reads and writes, from the environment as it is now (`HF_HUB_CACHE`, then
    `HF_HOME/hub`), not as it was when huggingface_hub was imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` (read now) forbids contacting the Hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def pull(hub_id: HubId | str, *, offline: bool | None = None, cache_dir: str | Path | None = None) -> Path:
    """The local snapshot directory of `hub_id`: from the cache when offline (or when the Hub cannot be reached
    and the cache has it), else downloaded with a progress bar. A `CheckpointError` names the id and the cache."""
    if isinstance(hub_id, str):
        parsed = HubId.parse(hub_id)
        if parsed is None:
            raise CheckpointError(f"{hub_id!r} is not a Hugging Face Hub id (write ORG/NAME or ORG/NAME@REVISION)")
        hub_id = parsed
    offline = hub_offline() if offline is None else offline
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    snapshot = _snapshot(hub_id, [*METADATA_PATTERNS, *WEIGHT_PATTERNS], offline, cache)
    if not offline and not any(snapshot.rglob("*.safetensors")):
        snapshot = _snapshot(hub_id, [*METADATA_PATTERNS, *TORCH_WEIGHT_PATTERNS], offline, cache)
    return snapshot


def _snapshot(hub_id: HubId, patterns: list[str], offline: bool, cache: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"the Hugging Face cache {cache}"
    try:
        return Path(snapshot_download(hub_id.repo, revision=hub_id.revision, cache_dir=cache, local_files_only=offline,
                                      allow_patterns=patterns))
    except LocalEntryNotFoundError:
        if offline:
            raise CheckpointError(
                f"checkpoint {hub_id} is not in {where} and HF_HUB_OFFLINE is set: fetch it first with "
                f"`mstar pull {hub_id}` where the Hub is reachable (same HF_HOME / HF_HUB_CACHE), or unset "
                "HF_HUB_OFFLINE") from None
        raise CheckpointError(f"checkpoint {hub_id}: the Hub cannot be reached and it is not in {where}; check the "
                              "network (or HF_ENDPOINT), or copy the model into that cache") from None
    except GatedRepoError:
        raise CheckpointError(f"checkpoint {hub_id} is gated on the Hub: accept its terms on huggingface.co and set "
                              f"HF_TOKEN (nothing of it is in {where})") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"checkpoint {hub_id}: no such model repository on the Hub (or it is private: set "
                              f"HF_TOKEN); nothing of it is in {where}") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"checkpoint {hub_id}: the repository has no revision {hub_id.revision!r} "
                              f"(nothing of it is in {where})") from None
    except (HfHubHTTPError, OSError) as exc:
        raise CheckpointError(f"checkpoint {hub_id}: downloading into {where} failed: {exc}") from None


def resolve_checkpoint(value: str) -> str:
    """A checkpoint as a local path: `value` itself when that path exists (or when it cannot be a Hub id, so the
    loader reports the missing path), else the snapshot directory of the Hub id `value` names (see `pull`)."""
    if Path(value).expanduser().exists():
        return value
    hub_id = HubId.parse(value)
    if hub_id is None:
        return value
    try:
        return str(pull(hub_id))
    except CheckpointError as exc:  # a mistyped local path reads like an id: say both were tried
        raise CheckpointError(f"no local path {value!r}, and {exc}") from None


def resolve_options(options):
    """`options` (a `LoadOptions`) with its checkpoint and its parts' checkpoints as local paths (`resolve_checkpoint`);
    the same object when nothing names the Hub."""
    checkpoint = resolve_checkpoint(options.checkpoint) if options.checkpoint else options.checkpoint
    parts: Mapping[str, str] = {name: resolve_checkpoint(value) for name, value in options.parts.items()}
    if checkpoint == options.checkpoint and parts == dict(options.parts):
        return options
    return attrs.evolve(options, checkpoint=checkpoint, parts=parts)
