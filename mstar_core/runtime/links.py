"""Worker links through the plugin registry: the transport a placement names carries a worker's tensors.

The core imports no transport plugin: it looks the name up in the registry (`mstar_register_transports`)
and asks the class for one end of a worker link (`Transport.worker_link`). Control messages always
travel on the ZeroMQ control socket, which the core owns; so `zmq`, the default, needs no plugin to
mean "every frame on that socket" when the zmq plugin is not loaded (`MSTAR_PLUGINS` left it out).
"""

from __future__ import annotations

from typing import Any

from mstar_core.errors import ConfigError
from mstar_core.wire.transport import InlineLink, Transport, TransportLink

#: The transport of workers whose placement names none.
DEFAULT_TRANSPORT = "zmq"


def carries_worker_links(cls: Any) -> bool:
    """True when a registered transport class can make worker links (overrides `Transport.worker_link`)."""
    method = getattr(cls, "worker_link", None)
    return method is not None and getattr(method, "__func__", None) is not Transport.worker_link.__func__


def link_transport(registry: Any, name: str) -> Any:
    """The registered class of transport `name`, or None for the built-in inline `zmq` link; ConfigError if unusable."""
    if name == DEFAULT_TRANSPORT and name not in registry.transports:
        return None
    if name not in registry.transports:
        known = sorted({*registry.transports, DEFAULT_TRANSPORT})
        raise ConfigError(f"unknown transport '{name}'; known: {', '.join(known)} (install the plugin that "
                          f"registers it, or check MSTAR_PLUGINS)")
    cls = registry.transports.get(name)
    if not carries_worker_links(cls):
        usable = sorted({n for n, c in registry.transports.items() if carries_worker_links(c)} | {DEFAULT_TRANSPORT})
        raise ConfigError(f"transport '{name}' cannot carry a worker's tensors; use one of: {', '.join(usable)}")
    return cls


def open_link(registry: Any, name: str, role: str) -> TransportLink:
    """One end (`role` 'server' or 'worker') of a worker link over transport `name`."""
    cls = link_transport(registry, name)
    return InlineLink(DEFAULT_TRANSPORT) if cls is None else cls.worker_link(role)
