"""The one sealed send: seal frames on a session's channel and hand them to a ZeroMQ socket in one go.

Every message after a worker's Hello travels sealed (`wire.session.Channel`): the control socket's
both ends (cluster, worker) and the peer line between workers (`peer_mailbox.PeerMailbox`). A channel
numbers what it seals, and the receiver opens only in order, so sealing and handing to the
socket must never be split by an await: this helper does both in one synchronous call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("mstar.links")


def send_sealed(sock: Any, channel: Any, frames: list[Any], *, head: Sequence[Any] = (),
                unawaited: str | None = None) -> Any:
    """Seal `frames` on `channel` and send them on `sock` now; returns the socket's send future.

    `head` goes unsealed in front (a ROUTER socket's routing id, a peer-line tag). With
    `unawaited` nobody waits for the send: a failure is logged as "`unawaited` could not be sent".
    """
    sent = sock.send_multipart([*head, *channel.seal(frames)], copy=False)
    if unawaited is not None:
        sent.add_done_callback(log_send_failure(unawaited))
    return sent


def log_send_failure(what: str) -> Callable[[Any], None]:
    """A done-callback for a send nobody awaits: retrieves its failure and logs it as `what` could not be sent."""

    def retrieve(sent: Any) -> None:
        if not sent.cancelled() and sent.exception() is not None:
            log.warning("%s could not be sent: %s", what, sent.exception())

    return retrieve
