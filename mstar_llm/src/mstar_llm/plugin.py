"""Entry point (group `mstar`, name `llm`): registers the `llama` model family."""

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_llm.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)
