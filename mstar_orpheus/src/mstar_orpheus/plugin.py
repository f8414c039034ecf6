"""Entry point (group `mstar`): registers the `orpheus` model and its speech API adapter."""

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_orpheus.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_orpheus.adapter import OrpheusSpeechAdapter  # imported lazily: `mstar plugins` stays fast

    register(OrpheusSpeechAdapter())
