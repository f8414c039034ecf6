"""The core's own plugin (the `function` engine, the `voice_agent` composition): registered through the `mstar` entry point like any third party."""

from mstar_core.plugins.hookspecs import hookimpl


@hookimpl
def mstar_register_engines(register):
    from mstar_core.runtime.function_engine import FunctionEngine

    register("function", FunctionEngine)


@hookimpl
def mstar_register_compositions(register):
    from mstar_core.compose.voice_agent import SPEC

    register(SPEC)
