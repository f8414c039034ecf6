"""Compatibility: `mstar_core.api.adapters` as plugins of the last release import it (now `requests.adapters`)."""

from mstar_core.api.requests.adapters import *  # noqa: F403
from mstar_core.api.requests.adapters import ROUTES, ApiAdapter, ApiAdapterProtocol, to_int16_pcm, to_png  # noqa: F401
