from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_wan.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_wan.adapter import WanVideosAdapter  # imported lazily: `mstar plugins` stays fast

    register(WanVideosAdapter())
