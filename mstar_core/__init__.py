"""M*: serve composite multimodal models as Walk Graphs on one asyncio runtime."""

__version__ = "0.1.0"

from mstar_core.compat import PLUGIN_API_VERSION, PluginAPIError, PluginAPIWarning
from mstar_core.errors import GraphValidationError, MStarError, RequestError
from mstar_core.plugins.hookspecs import hookimpl

__all__ = ["PLUGIN_API_VERSION", "GraphValidationError", "MStarError", "PluginAPIError", "PluginAPIWarning",
           "RequestError", "__version__", "hookimpl"]
