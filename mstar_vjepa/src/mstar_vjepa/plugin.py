"""Entry point `vjepa` (group `mstar`): the V-JEPA 2 model families and the AC rollout engine."""

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_vjepa.model import SPECS

    for spec in SPECS:
        register(spec)


@hookimpl
def mstar_register_engines(register):
    from mstar_vjepa.nodes import ACRolloutEngine

    register(ACRolloutEngine.kind, ACRolloutEngine)
