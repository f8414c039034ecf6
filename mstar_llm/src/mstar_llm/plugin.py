"""Entry point (group `mstar`, name `llm`): registers the `llama` model family."""

from mstar_core.plugins import hookimpl
from mstar_llm.model import SPEC  # (loaded with the package anyway: `mstar_llm/__init__` exports it)


@hookimpl
def mstar_register_models(register):
    register(SPEC)
