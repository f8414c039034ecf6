"""The OpenAI Realtime API (GA event protocol) at `/v1/realtime?model=NAME`, over any served chat or speech model.

Files, one job each (the socket itself, handshake, admission, receive loop and sender, is the route
`mstar_core/api/routes/realtime.py`): `session.py` (state
and client-event handlers), `response.py` (one response's request and server events), `config.py`
(`session.update` / `response.create` checked), `conversation.py` (items, bounded history, rendering),
`bridge.py` (the model through its API adapter), `vad.py` (server turn detection), `protocol.py` (ids, events,
pcm16), `limits.py` (bounds and their `MSTAR_REALTIME_*` overrides).
"""
