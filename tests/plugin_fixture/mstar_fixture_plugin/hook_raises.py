"""A plugin that imports fine but whose registration hook raises, to prove the others still load.

Its models hook succeeds and its engines hook registers one engine before raising: neither may
show, since a half-registered plugin is worse than none.
"""

import types

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_models(register):
    register(types.SimpleNamespace(name="fixture-half-registered"))


@hookimpl
def mstar_register_engines(register):
    register("fixture_half_registered", object)
    raise RuntimeError("fixture plugin hook fails on purpose")
