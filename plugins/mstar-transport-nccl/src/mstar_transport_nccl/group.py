"""A private two-rank torch.distributed group: the rendezvous store, the gloo/NCCL group on top of it.

torch's TCPStore has no authentication, so the store's listening socket is made here and bound to
exactly the host asked for (loopback unless a caller allowed more), instead of torch's default of
every interface; gloo's own data connections are bound the same way.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from mstar_core.wire.errors import TransportError
from mstar_core.wire.transport import is_loopback_host

BACKENDS = ("nccl", "gloo")


def pick_backend(device: str | torch.device | None, forced: str | None = None) -> str:
    """`forced` if given, else NCCL for a CUDA device and gloo for anything else; checked against this machine."""
    backend = forced or ("nccl" if torch.device(device or "cpu").type == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise TransportError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise TransportError("backend 'nccl' needs CUDA and a torch built with NCCL; use backend: gloo on CPU")
    return backend


def host_of(address: str) -> str:
    """The host of a control address (`tcp://HOST:PORT`); loopback for ipc:// (a peer on this machine)."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return "127.0.0.1"
    return rest.rsplit(":", 1)[0].strip("[]")


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    if is_loopback_host(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def master_store(host: str, timeout: datetime.timedelta) -> tuple[Any, socket.socket]:
    """Rank 0's store, listening on `host` only; returns (store, its listening socket: keep it open)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host if host not in ("*", "") else "0.0.0.0", 0))
        listener.listen(16)
    except OSError as exc:
        listener.close()
        raise TransportError(f"cannot open a rendezvous store on {host}: {exc}") from None
    port = listener.getsockname()[1]
    store = dist.TCPStore(host, port, world_size=2, is_master=True, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    return store, listener


def client_store(host: str, port: int, timeout: datetime.timedelta) -> Any:
    """Rank 1's connection to rank 0's store."""
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def two_rank_group(store: Any, rank: int, backend: str, timeout: datetime.timedelta, hostname: str | None) -> Any:
    """A gloo or NCCL process group of ranks {0, 1} over `store` (gloo's sockets on `hostname`, if given)."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        gloo = dist.ProcessGroupGloo
        opts._devices = [gloo.create_device(hostname=hostname) if hostname else gloo.create_default_device()]
        opts._timeout = timeout
        return gloo(store, rank, 2, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)
