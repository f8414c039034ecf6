"""The HTTP API: OpenAI-shaped routes over `AsyncEngine`, with models plugged in through API adapters.

Layers, arrows downward only (the `api layers` import-linter contract in pyproject.toml):

    server     the app and its state, middleware, metrics, drain, launch, deploy file, playground, offline command
    routes     one module per route: read the OpenAI request, call the pipeline, shape the response
    realtime   the realtime session's protocol, state and conversation (its route is `routes/realtime.py`)
    batch      (beside realtime) the Batch API's files, jobs on disk and runner (routes `files.py`, `batches.py`)
    requests   the one pipeline for text and voice requests, the adapters' hooks, submission to the engine
    media      decode and bound images, audio, video, tensors
    http       errors and bodies

`adapters.py`, `video.py`, `errors.py` and `common.py` here are the import paths plugins of the last release use,
kept as re-exports of the new homes; nothing inside the layers imports them.
"""

from mstar_core.api.requests.adapters import ROUTES, ApiAdapter, ApiAdapterProtocol, to_int16_pcm, to_png
from mstar_core.api.requests.chat_adapter import TokenizerChatAdapter

__all__ = ["ROUTES", "ApiAdapter", "ApiAdapterProtocol", "TokenizerChatAdapter", "to_int16_pcm", "to_png"]
