"""The control link to other hosts: a shared secret to start, CURVE on the wire, only key holders join.

These run on loopback with `control.encrypt: true` (the same code path a non-loopback bind takes
without the choice); `test_two_hosts.py` runs it between two network namespaces.
"""

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from mstar_core.cluster.cluster import Cluster
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import ConfigError, MStarError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.wire.curve import needs_encryption

pytestmark = pytest.mark.timeout(180)

SECRET = "correct horse battery staple"
#: message names that must never appear on an encrypted link
PLAINTEXT_NAMES = (b"invoke_node", b"node_result", b"heartbeat", b"load_model", b"hello")


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join(address: str, name: str, secret: str | None = SECRET, *extra: str, timeout: float = 30.0):
    env = {k: v for k, v in os.environ.items() if k != "MSTAR_SECRET"}
    if secret is not None:
        env["MSTAR_SECRET"] = secret
    env["MSTAR_JOIN_TIMEOUT"] = str(timeout)
    return subprocess.Popen([sys.executable, "-m", "mstar_core.cluster.worker", "--join", address, "--name", name,
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_which_addresses_are_encrypted():
    assert needs_encryption("tcp://10.0.0.2:7100") and needs_encryption("tcp://0.0.0.0:7100")
    assert not needs_encryption("tcp://127.0.0.1:7100") and not needs_encryption("ipc:///tmp/x/control")
    assert not needs_encryption("tcp://localhost:1") and not needs_encryption("tcp://[::1]:1")


async def test_a_bind_to_other_hosts_refuses_to_start_without_a_shared_secret():
    # refused before anything binds: no socket is opened on that address
    cluster = Cluster(bind="tcp://10.213.0.1:7100")
    with pytest.raises(MStarError, match="set MSTAR_SECRET"):
        await cluster.start()
    cluster.socket.close()
    cluster = Cluster(bind="tcp://10.213.0.1:7100", secret=SECRET.encode(), encrypt=False)
    with pytest.raises(MStarError, match="always encrypted"):
        await cluster.start()
    cluster.socket.close()


def test_placement_control_encrypt_and_bind_are_checked():
    p = Placement.from_dict({"control": {"bind": "tcp://10.0.0.2:7100", "encrypt": True}})
    assert p.bind == "tcp://10.0.0.2:7100" and p.encrypt is True
    assert Placement.from_dict({}).encrypt is None
    with pytest.raises(ConfigError, match="control.encrypt must be true or false"):
        Placement.from_dict({"control": {"encrypt": "yes"}})
    with pytest.raises(ConfigError, match="control.bind must be an address"):
        Placement.from_dict({"control": {"bind": 7100}})


async def test_serving_process_without_secret_refuses_a_remote_bind(monkeypatch):
    monkeypatch.delenv("MSTAR_SECRET", raising=False)
    placement = Placement.from_dict({"workers": {"w": {}}, "nodes": {"bump": "w"},
                                     "control": {"bind": "tcp://10.213.0.1:7100"}})
    engine = placed_engine(discover())
    try:
        with pytest.raises(Exception, match="MSTAR_SECRET"):
            await engine.load_model("fixture-blob", LoadOptions(), placement=placement)
    finally:
        await engine.close()


async def test_encrypted_control_only_key_holders_join_and_nothing_readable_goes_on_the_wire(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("MSTAR_SECRET", SECRET)
    address = free_address()
    port = address.rsplit(":", 1)[1]
    capture = None
    if shutil.which("tcpdump") and os.geteuid() == 0:
        pcap = tmp_path / "lo.pcap"
        capture = subprocess.Popen(["tcpdump", "-i", "lo", "-U", "-s", "0", "-w", str(pcap), f"tcp port {port}"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # tcpdump needs a moment before it captures
    placement = Placement.from_dict({"workers": {"far": {"host": "127.0.0.1"}},
                                     "nodes": {"bump": "far"},
                                     "control": {"bind": address, "encrypt": True, "heartbeat_interval": 0.2}})
    engine = placed_engine(discover())
    # on loopback a worker encrypts when told to (to another host's address it does by itself)
    bad = [join(address, "far", "the wrong secret, long enough", "--encrypt", "on", timeout=4),
           join(address, "far", SECRET, timeout=4),  # the right secret, unencrypted
           join(address, "far", None, "--encrypt", "on", timeout=4)]
    good = join(address, "far", SECRET, "--encrypt", "on")
    try:
        await asyncio.wait_for(engine.load_model("fixture-blob", LoadOptions(), placement=placement), 90)
        assert engine.cluster.encrypted
        for worker in bad:
            out, _ = await asyncio.to_thread(worker.communicate, timeout=30)
            assert worker.returncode != 0, out
            assert "no answer" in out or "MSTAR_SECRET" in out, out
        far = engine.cluster.workers["far"]
        assert far.pid == good.pid and far.restarts == 0  # only the worker holding the key joined
        x = torch.randn(64, 64)
        assert torch.equal((await engine.submit("fixture-blob", {"x": x}).result())["y"], x + 1)
        os.kill(good.pid, signal.SIGKILL)  # a hand-joined worker dies: its requests fail at once
        await asyncio.to_thread(good.wait, 10)
        handle = engine.submit("fixture-blob", {"x": x})
        with pytest.raises(Exception, match="far"):
            await asyncio.wait_for(handle.result(), 10)
    finally:
        await engine.close()
        for p in [*bad, good]:
            if p.poll() is None:
                p.kill()
        if capture is not None:
            capture.send_signal(signal.SIGINT)
            capture.wait(10)
    if capture is None:
        pytest.skip("tcpdump is not installed (or not root): the capture check did not run")
    data = pcap.read_bytes()
    assert len(data) > 10_000, "the capture saw no traffic"
    assert not [name for name in PLAINTEXT_NAMES if name in data]
