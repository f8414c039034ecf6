"""Entry point `vjepa` (group `mstar`): the V-JEPA 2 model families (served on the shared engines)."""

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_vjepa.model import SPECS  # imported lazily: `mstar plugins` stays fast

    for spec in SPECS:
        register(spec)
