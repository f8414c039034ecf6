"""Entry point (group `mstar`): registers the `orpheus` model and its speech API adapter."""

from mstar_core.plugins import hookimpl
from mstar_orpheus.model import SPEC  # (loaded with the package anyway: `mstar_orpheus/__init__` exports it)


@hookimpl
def mstar_register_models(register):
    register(SPEC)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_orpheus.adapter import OrpheusSpeechAdapter  # imported lazily: `mstar plugins` stays fast

    register(OrpheusSpeechAdapter())
