from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_wan.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)
