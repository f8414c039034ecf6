"""The HTTP API: OpenAI-shaped routes over `AsyncEngine`, with models plugged in through API adapters."""

from mstar_core.api.adapters import ROUTES, ApiAdapter, ApiAdapterProtocol, to_int16_pcm, to_png
from mstar_core.api.chat_adapter import TokenizerChatAdapter

__all__ = ["ROUTES", "ApiAdapter", "ApiAdapterProtocol", "TokenizerChatAdapter", "to_int16_pcm", "to_png"]
