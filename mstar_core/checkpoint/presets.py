"""Where tiny presets live, and writing one exactly once even when several processes load it at once."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def preset_root() -> Path:
    """`$MSTAR_CACHE/presets`, else `~/.cache/mstar/presets`."""
    return Path(os.environ.get("MSTAR_CACHE", Path.home() / ".cache" / "mstar")) / "presets"


def ensure_preset(name: str, marker: str, write: Callable[[Path], Any]) -> Path:
    """The directory of preset `name`, written by `write(dir)` on first use.

    `write` fills a private staging directory that is renamed into place, so a concurrent loader
    (a server and its worker processes, parallel tests) sees either nothing or the whole preset;
    `marker` is a file whose presence means the preset is complete.
    """
    target = preset_root() / name
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write(staging)
        if not (staging / marker).is_file():
            raise RuntimeError(f"preset writer for '{name}' did not produce {marker}")
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical (same seed)
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
