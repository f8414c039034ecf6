"""Entry point (group `mstar`, name `whisper`): registers the `whisper` model and its audio API adapter."""

from mstar_core.plugins import hookimpl
from mstar_whisper.model import SPEC  # (loaded with the package anyway: `mstar_whisper/__init__` exports it)


@hookimpl
def mstar_register_models(register):
    register(SPEC)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_whisper.adapter import WhisperAudioAdapter  # imported lazily: `mstar plugins` stays fast

    register(WhisperAudioAdapter())
