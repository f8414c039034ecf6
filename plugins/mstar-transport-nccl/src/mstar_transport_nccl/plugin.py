"""Entry point: registers the `nccl` transport."""

from mstar_core.plugins import hookimpl
from mstar_transport_nccl.transport import NcclTransport


@hookimpl
def mstar_register_transports(register):
    register("nccl", NcclTransport)
