from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_bagel.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_bagel.adapter import BagelImagesAdapter  # imported lazily: `mstar plugins` stays fast

    register(BagelImagesAdapter())
