"""`fixture_spool`: a third-party-style transport that carries a worker link's big frames through files.

It proves that the transport a placement names really carries the traffic: every frame of at least
`THRESHOLD` bytes is written to a file in a private spool directory and replaced by its name; the
receiving end reads the file back and deletes it. Same host only, like shared memory.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import uuid
from collections.abc import Sequence
from typing import Any

import orjson

from mstar_core.wire.errors import TransportError, WireError
from mstar_core.wire.transport import Transport, TransportLink

TAG = b"fixture-spool/1"
THRESHOLD = 4096


def spool_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"mstar-fixture-spool-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class SpoolLink(TransportLink):
    """One end of a worker link whose big frames travel as files."""

    def __init__(self) -> None:
        super().__init__("fixture_spool")
        self.dir = spool_dir()
        self.spooled_out = self.spooled_in = 0
        self._names = itertools.count()
        self._prefix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def _pack(self, frames: Sequence[Any]) -> list[Any]:
        desc, inline = [], []
        for frame in frames:
            view = memoryview(frame)
            if view.nbytes < THRESHOLD:
                desc.append(None)
                inline.append(frame)
                continue
            name = f"{self._prefix}-{next(self._names)}"
            with open(os.path.join(self.dir, name), "wb") as f:
                f.write(view)
            desc.append(name)
            self.spooled_out += 1
            self.stats.offloaded_bytes += view.nbytes
        return [TAG, orjson.dumps(desc), *inline]

    def _unpack(self, frames: Sequence[Any]) -> list[Any]:
        if not frames or bytes(memoryview(frames[0])) != TAG:
            return list(frames)
        try:
            desc, inline, out = orjson.loads(bytes(memoryview(frames[1]))), iter(frames[2:]), []
            for name in desc:
                if name is None:
                    out.append(next(inline))
                    continue
                if not isinstance(name, str) or os.sep in name or name.startswith("."):
                    raise ValueError(f"bad spool name {name!r}")
                path = os.path.join(self.dir, name)
                with open(path, "rb") as f:
                    out.append(f.read())
                os.unlink(path)
                self.spooled_in += 1
            return out
        except (ValueError, TypeError, IndexError, StopIteration, OSError, orjson.JSONDecodeError) as exc:
            raise WireError(f"malformed spool message: {exc}") from None


class SpoolTransport(Transport):
    """Only a worker link (no point-to-point channel): enough for a placement to select it."""

    name = "fixture_spool"
    same_host = True

    @classmethod
    def worker_link(cls, role: str) -> TransportLink:
        return SpoolLink()

    def bind(self, address: str) -> str:
        raise TransportError("fixture_spool only carries worker links")

    connect = send = recv = bind

    def close(self) -> None:
        return None
