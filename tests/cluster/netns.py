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
