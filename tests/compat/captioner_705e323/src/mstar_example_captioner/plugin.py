"""Entry point (group `mstar`, name `example_captioner`): registers the `example-captioner` model."""

from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_example_captioner.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)
