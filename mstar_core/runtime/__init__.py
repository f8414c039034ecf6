"""The in-process runtime: conductor, micro-schedulers, engine contract, AsyncEngine."""

from mstar_core.runtime.async_engine import AsyncEngine
from mstar_core.runtime.engine import Engine, EngineContext, Invocation
from mstar_core.runtime.request import Output, RequestHandle

__all__ = ["AsyncEngine", "Engine", "EngineContext", "Invocation", "Output", "RequestHandle"]
