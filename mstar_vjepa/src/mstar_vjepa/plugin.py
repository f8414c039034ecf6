"""Entry point `vjepa` (group `mstar`): the V-JEPA 2 model families and the AC rollout and CEM engines."""

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_vjepa.model import SPECS

    for spec in SPECS:
        register(spec)


@hookimpl
def mstar_register_engines(register):
    from mstar_vjepa.engines import ACRolloutEngine, CEMPlanEngine

    for engine in (ACRolloutEngine, CEMPlanEngine):
        register(engine.kind, engine)
