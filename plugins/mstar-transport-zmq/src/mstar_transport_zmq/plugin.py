"""Entry point: registers the `zmq` transport."""

from mstar_core.plugins import hookimpl
from mstar_transport_zmq.transport import ZmqTransport


@hookimpl
def mstar_register_transports(register):
    register("zmq", ZmqTransport)
