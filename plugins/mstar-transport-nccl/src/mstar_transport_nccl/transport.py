"""NcclTransport: a two-rank torch.distributed process group used as a point-to-point frame channel.

`bind("tcp://127.0.0.1:PORT")` makes this process rank 0 and hosts the rendezvous store;
`connect` (same address) makes it rank 1. Each message is sent as: a frame count, the frame sizes
(int64), then each frame as a flat uint8 tensor. With NCCL, frames that are already device tensors
(`encode(msg, keep_device=True)`) go GPU to GPU without a host copy, and received frames stay on the
device; with gloo everything is on the CPU. The group is private to this transport, so several can
coexist with a process's default group. The rendezvous store listens while the group forms; keep the
address on loopback unless `allow_remote=True` (torch's store has no authentication of its own).
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import Transport, TransportLink, check_bind_address


def _hostport(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise TransportError(f"nccl/gloo rendezvous needs tcp://HOST:PORT, got {address!r}")
    host, _, port = address[len("tcp://"):].rpartition(":")
    if not port.isdigit() or not host:
        raise TransportError(f"bad rendezvous address {address!r}; expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


class NcclTransport(Transport):
    """Point-to-point frames over torch.distributed; backend 'nccl' when CUDA is available, else 'gloo'.

    As a placement's `transport: nccl`, it carries a worker's big tensor frames (`link.DistLink`).
    """

    name = "nccl"
    link_options = frozenset({"backend", "threshold", "allow_remote", "timeout_s", "device"})

    @classmethod
    def worker_link(cls, role: str, **options: Any) -> TransportLink:
        from mstar_transport_nccl.link import DistLink

        return DistLink(role, **options)

    @classmethod
    def check_link_options(cls, options: Mapping[str, Any], *, remote: bool) -> None:
        super().check_link_options(options, remote=remote)
        backend = options.get("backend")
        if backend is not None and backend not in ("nccl", "gloo"):
            raise TransportError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        for key, kind in (("allow_remote", bool), ("threshold", int), ("timeout_s", (int, float)), ("device", str)):
            if key in options and (isinstance(options[key], bool) and kind is not bool
                                   or not isinstance(options[key], kind)):
                raise TransportError(f"option {key} must be a {getattr(kind, '__name__', 'number')}, "
                                     f"got {options[key]!r}")
        if remote and not options.get("allow_remote"):
            raise TransportError(
                "the control bind reaches other hosts, but an nccl/gloo link's rendezvous store and group "
                "connections have no authentication or encryption (anyone who reaches them could join or read the "
                "tensors); keep control.bind on loopback, or set `transport: {name: nccl, allow_remote: true}` "
                "on a network you trust")

    def __init__(self, *, backend: str | None = None, device: str | None = None, secret: bytes | None = None,
                 allow_remote: bool = False, timeout_s: float = 60.0):
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.backend not in ("nccl", "gloo"):
            raise TransportError(f"backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise TransportError("backend 'nccl' needs CUDA; use backend='gloo' on CPU")
        self.device = torch.device(device or ("cuda" if self.backend == "nccl" else "cpu"))
        self.secret, self.allow_remote = secret, allow_remote
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._group = None
        self._peer = -1

    def _join(self, address: str, rank: int) -> None:
        if self._group is not None:
            raise TransportError("transport already bound or connected; make a new one")
        host, port = _hostport(address)
        store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0, timeout=self.timeout,
                              wait_for_workers=False)
        if self.backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, 2, self.timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            group = dist.ProcessGroupNCCL(store, rank, 2, opts)
        self._store, self._group, self._peer = store, group, 1 - rank

    def bind(self, address: str) -> str:
        """Host the rendezvous on `address` and become rank 0; blocks until the peer connects."""
        check_bind_address(address, allow_remote=self.allow_remote, secret=self.secret)
        self._join(address, 0)
        return address

    def connect(self, address: str) -> None:
        """Join the rendezvous at `address` as rank 1."""
        self._join(address, 1)

    def _p2p(self, tensor: torch.Tensor, send: bool) -> None:
        if self._group is None:
            raise TransportError("transport is not bound/connected (or closed)")
        op = self._group.send if send else self._group.recv
        op([tensor], self._peer, 0).wait()

    def send(self, frames: Sequence[Any]) -> None:
        flats = []
        for f in frames:
            if isinstance(f, torch.Tensor):
                flats.append(f.reshape(-1).view(torch.uint8) if f.numel() else f.new_empty(0, dtype=torch.uint8))
            else:
                mv = memoryview(f)
                with warnings.catch_warnings():  # read-only source buffers are only read here
                    warnings.simplefilter("ignore", UserWarning)
                    flat = torch.frombuffer(mv, dtype=torch.uint8) if mv.nbytes else torch.empty(0, dtype=torch.uint8)
                flats.append(flat)
        sizes = torch.tensor([len(flats), *[t.numel() for t in flats]], dtype=torch.int64)
        self._p2p(torch.tensor([sizes.numel()], dtype=torch.int64, device=self.device), True)
        self._p2p(sizes.to(self.device), True)
        for t in flats:
            if t.numel():
                self._p2p(t.to(self.device, non_blocking=False), True)

    def recv(self, timeout: float | None = None) -> list[Any]:
        """Receive one message (`timeout` is the group's, set at construction); tensor frames stay tensors."""
        n = torch.empty(1, dtype=torch.int64, device=self.device)
        self._p2p(n, False)
        sizes = torch.empty(int(n.item()), dtype=torch.int64, device=self.device)
        self._p2p(sizes, False)
        out: list[Any] = []
        for i, size in enumerate(sizes.tolist()[1:]):
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
            if size:
                self._p2p(t, False)
            # The JSON header is read on the host; tensor frames stay where they landed.
            out.append(t.cpu().numpy().tobytes() if i == 0 else t)
        return out

    def close(self) -> None:
        if self._group is not None:
            self._group = None
            self._store = None
