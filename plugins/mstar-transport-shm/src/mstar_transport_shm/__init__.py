"""Shared-memory transport for M*: an owner-pid-named arena in /dev/shm, zero-copy receive, no leaks on death."""

from mstar_transport_shm.arena import Arena, Mapping, segment_names, sweep_stale
from mstar_transport_shm.transport import ShmTransport

__all__ = ["Arena", "Mapping", "ShmTransport", "segment_names", "sweep_stale"]
