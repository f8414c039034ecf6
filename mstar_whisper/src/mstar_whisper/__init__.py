"""M* model package for Whisper: `ModelSpec("whisper")` with preset `tiny`."""

from mstar_whisper.model import SPEC, load

__all__ = ["SPEC", "load"]
