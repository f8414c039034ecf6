"""The core's own plugin (the `function` engine): registered through the `mstar` entry point like any third party."""

from mstar_core.plugins.hookspecs import hookimpl


@hookimpl
def mstar_register_engines(register):
    from mstar_core.runtime.function_engine import FunctionEngine

    register("function", FunctionEngine)
