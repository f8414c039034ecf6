"""Two "hosts" on one machine for tests: network namespaces joined by a veth pair, each with its own address.

Needs root and `ip` (iproute2). `two_hosts()` yields the namespaces and addresses and removes both
namespaces (and with them the veth pair) on the way out, whatever happened inside; processes
started with `NetnsHosts.popen` are killed first. Traffic stays on the veth pair: nothing is routed
anywhere else.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import attrs


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"mstar-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@attrs.define
class NetnsHosts:
    a: str  # namespace names
    b: str
    addr_a: str  # their addresses on the veth pair
    addr_b: str
    dev_a: str
    dev_b: str
    processes: list = attrs.field(factory=list)

    def popen(self, ns: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside namespace `ns` (killed when the hosts are torn down)."""
        process = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **kwargs)
        self.processes.append(process)
        return process


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[NetnsHosts]:
    tag = os.getpid() % 100_000
    subnet = f"10.213.{tag % 250}"
    hosts = NetnsHosts(a=f"mstar-a-{tag}", b=f"mstar-b-{tag}", addr_a=f"{subnet}.1", addr_b=f"{subnet}.2",
                       dev_a=f"mva{tag}", dev_b=f"mvb{tag}")
    try:
        _ip("netns", "add", hosts.a)
        _ip("netns", "add", hosts.b)
        _ip("link", "add", hosts.dev_a, "type", "veth", "peer", "name", hosts.dev_b)
        _ip("link", "set", hosts.dev_a, "netns", hosts.a)
        _ip("link", "set", hosts.dev_b, "netns", hosts.b)
        for ns, dev, addr in ((hosts.a, hosts.dev_a, hosts.addr_a), (hosts.b, hosts.dev_b, hosts.addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for process in hosts.processes:
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(Exception):
                    process.wait(10)
        subprocess.run(["ip", "link", "del", hosts.dev_a], capture_output=True)  # if it never moved
        for ns in (hosts.a, hosts.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@attrs.define
class NamespacedWorkerHost:
    """This host (the root namespace) and one namespace joined to it by a veth pair: a worker's "other host"."""

    ns: str  # the namespace's name
    addr_here: str  # this end's address (bind the control socket here)
    addr_there: str  # the namespace's address
    dev_here: str  # the veth ends
    dev_there: str
    processes: list = attrs.field(factory=list)

    def popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` inside the namespace (killed when it is torn down)."""
        process = subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], **kwargs)
        self.processes.append(process)
        return process


@contextlib.contextmanager
def worker_namespace() -> Iterator[NamespacedWorkerHost]:
    """A namespace for a worker, linked to this host's root namespace; removed (veth and all) on the way out."""
    tag = os.getpid() % 100_000
    subnet = f"10.214.{tag % 250}"
    host = NamespacedWorkerHost(ns=f"mstar-w-{tag}", addr_here=f"{subnet}.1", addr_there=f"{subnet}.2",
                                dev_here=f"mwh{tag}", dev_there=f"mwt{tag}")
    try:
        _ip("netns", "add", host.ns)
        _ip("link", "add", host.dev_here, "type", "veth", "peer", "name", host.dev_there)
        _ip("link", "set", host.dev_there, "netns", host.ns)
        _ip("addr", "add", f"{host.addr_here}/24", "dev", host.dev_here)
        _ip("link", "set", host.dev_here, "up")
        _ip("-n", host.ns, "addr", "add", f"{host.addr_there}/24", "dev", host.dev_there)
        _ip("-n", host.ns, "link", "set", host.dev_there, "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        yield host
    finally:
        for process in host.processes:
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(Exception):
                    process.wait(10)
        subprocess.run(["ip", "link", "del", host.dev_here], capture_output=True)  # takes its peer with it
        subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)
