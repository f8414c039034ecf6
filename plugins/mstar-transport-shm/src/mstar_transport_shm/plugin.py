"""Entry point: registers the `shm` transport."""

from mstar_core.plugins import hookimpl
from mstar_transport_shm.transport import ShmTransport


@hookimpl
def mstar_register_transports(register):
    register("shm", ShmTransport)
