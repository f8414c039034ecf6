from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_pi05.model import SPECS  # imported lazily: `mstar plugins` stays fast

    for spec in SPECS:
        register(spec)
