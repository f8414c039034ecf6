"""M*: serve composite multimodal models as Walk Graphs on one asyncio runtime."""

__version__ = "0.1.0"

from mstar_core.errors import GraphValidationError, MStarError, RequestError
from mstar_core.plugins.hookspecs import hookimpl

__all__ = ["GraphValidationError", "MStarError", "RequestError", "__version__", "hookimpl"]
