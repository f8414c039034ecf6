"""Errors raised by the wire codec and the transports."""

from mstar_core.errors import MStarError


class WireError(MStarError, ValueError):
    """A message or frame could not be encoded or decoded; the message says which part is wrong."""


class AuthError(WireError):
    """A peer failed authentication (wrong or missing shared secret, stale or replayed hello)."""


class TransportError(MStarError):
    """A transport could not bind, connect, send or receive; the message says what to change."""
