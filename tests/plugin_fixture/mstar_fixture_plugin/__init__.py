"""A third-party-style plugin used by the tests: one model and one engine, registered by entry point."""

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_engines(register):
    from mstar_fixture_plugin.engine import EchoEngine

    register("fixture_echo", EchoEngine)


@hookimpl
def mstar_register_models(register):
    from mstar_fixture_plugin.model import SPEC

    register(SPEC)
