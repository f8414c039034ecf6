"""Wire codec (typed control messages + raw tensor frames, no pickle) and the transport interface."""

from mstar_core.wire.codec import decode, encode
from mstar_core.wire.errors import AuthError, TransportError, WireError
from mstar_core.wire.messages import (
    MESSAGES,
    ErrorReport,
    Heartbeat,
    Hello,
    InvokeNode,
    LoadModel,
    LoopDone,
    LoopValues,
    ModelLoaded,
    NodeResult,
    Release,
    RunLoop,
    Shutdown,
    Welcome,
    message,
)

__all__ = [
    "MESSAGES",
    "AuthError",
    "ErrorReport",
    "Heartbeat",
    "Hello",
    "InvokeNode",
    "LoadModel",
    "LoopDone",
    "LoopValues",
    "ModelLoaded",
    "NodeResult",
    "Release",
    "RunLoop",
    "Shutdown",
    "TransportError",
    "Welcome",
    "WireError",
    "decode",
    "encode",
    "message",
]
