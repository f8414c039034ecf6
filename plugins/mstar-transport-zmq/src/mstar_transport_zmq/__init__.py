"""ZeroMQ transport for M*: TCP and IPC, zero-copy multipart sends, CURVE keys derived from a shared secret."""

from mstar_transport_zmq.transport import ZmqTransport

__all__ = ["ZmqTransport"]
